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


def parse_tune_settings(cfg: dict[str, Any]) -> TuneSettings:
    """The ``tune`` node of conf/tune.yaml (a plain dict) as settings; ConfigError on an impossible value."""
    budget = _number(cfg, "budget_min", float)
    if budget <= 0:
        raise ConfigError("tune.budget_min", f"must be > 0 minutes, got {budget:g}", "set tune.budget_min=30")
    steps = _number(cfg, "steps", int)
    if steps < MIN_STEPS:
        raise ConfigError(
            "tune.steps",
            f"{steps} steps leave too few steady steps to diagnose",
            f"set tune.steps={MIN_STEPS} or more",
        )
    rounds = _number(cfg, "max_rounds", int)
    if rounds < 1:
        raise ConfigError("tune.max_rounds", f"must be >= 1, got {rounds}", "set tune.max_rounds=1 or more")
    repeats = _number(cfg, "repeats", int)
    if repeats < MIN_REPEATS:
        raise ConfigError(
            "tune.repeats",
            f"{repeats} rounds cannot resolve a 3% change",
            f"set tune.repeats={MIN_REPEATS} or more",
        )
    most = _number(cfg, "max_repeats", int)
    if most < repeats:
        raise ConfigError("tune.max_repeats", f"{most} is below tune.repeats={repeats}", f"set it to {repeats} or more")
    tolerance = _number(cfg, "loss_tolerance", float)
    if not 0 < tolerance < 1:
        raise ConfigError(
            "tune.loss_tolerance", f"must lie in (0, 1), got {tolerance:g}", "set tune.loss_tolerance=0.02 (2%)"
        )
    min_cost = _number(cfg, "min_cost", float)
    if not 0 < min_cost < 1:
        raise ConfigError("tune.min_cost", f"must lie in (0, 1), got {min_cost:g}", "set tune.min_cost=0.05 (5%)")
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
