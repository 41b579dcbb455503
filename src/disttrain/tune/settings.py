"""``tune.*`` settings as a typed object, checked before any run starts: a bad value names its key and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disttrain.config.errors import ConfigError, did_you_mean
from disttrain.tune.levers import MATH_CHANGING

MIN_STEPS = 10  # fewer steps leave too few steady steps past warm-up for a diagnosis
MIN_REPEATS = 3  # the A/B's own floor (python -m diagnose --repeats)


@dataclass(frozen=True)
class TuneSettings:
    budget_min: float
    steps: int
    max_rounds: int
    allow: tuple[str, ...]
    repeats: int
    max_repeats: int
    loss_tolerance: float
    min_cost: float
    output_dir: Path | None

    @property
    def budget_s(self) -> float:
        return 60.0 * self.budget_min


def _number(cfg: dict[str, Any], key: str, kind: type) -> Any:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
        raise ConfigError(
            f"tune.{key}",
            f"must be {'an integer' if kind is int else 'a number'}, got {value!r}",
            f"set tune.{key}=<{'int' if kind is int else 'number'}>",
        )
    return kind(value)


def _at_least(cfg: dict[str, Any], key: str, low: int, why: str) -> int:
    value = _number(cfg, key, int)
    if value < low:
        raise ConfigError(f"tune.{key}", f"{value} {why}", f"set tune.{key}={low} or more")
    return value


def _share(cfg: dict[str, Any], key: str, example: str) -> float:
    value = _number(cfg, key, float)
    if not 0 < value < 1:
        raise ConfigError(f"tune.{key}", f"must lie in (0, 1), got {value:g}", f"set tune.{key}={example}")
    return value


def parse_tune_settings(cfg: dict[str, Any]) -> TuneSettings:
    """The ``tune`` node of conf/tune.yaml (a plain dict) as settings; ConfigError on an impossible value."""
    budget = _number(cfg, "budget_min", float)
    if budget <= 0:
        raise ConfigError("tune.budget_min", f"must be > 0 minutes, got {budget:g}", "set tune.budget_min=30")
    steps = _at_least(cfg, "steps", MIN_STEPS, "steps leave too few steady steps to diagnose")
    rounds = _at_least(cfg, "max_rounds", 1, "A/B tests would test nothing")
    repeats = _at_least(cfg, "repeats", MIN_REPEATS, "rounds cannot resolve a 3% change")
    most = _at_least(cfg, "max_repeats", repeats, f"is below tune.repeats={repeats}")
    tolerance = _share(cfg, "loss_tolerance", "0.02 (2%)")
    min_cost = _share(cfg, "min_cost", "0.05 (5%)")
    allow = cfg.get("allow") or []
    if isinstance(allow, str):
        allow = [allow]
    for name in allow:
        if name not in MATH_CHANGING:
            raise ConfigError(
                "tune.allow",
                f"unknown lever class '{name}'{did_you_mean(str(name), MATH_CHANGING)}",
                f"name classes that change the training math: tune.allow=[{','.join(MATH_CHANGING)}]",
            )
    output = cfg.get("output_dir")
    return TuneSettings(
        budget, steps, rounds, tuple(allow), repeats, most, tolerance, min_cost, Path(output) if output else None
    )
