"""``run.json``, the run's manifest: one schema for the run that writes it and the analysis that reads it.

The training run (``disttrain.job``) fills it as the run goes (running -> completed | stopped | failed) and
writes it whole each time; the analysis, the sweep report and ``python -m diagnose`` read it back, possibly on
a laptop, possibly written by an older or newer version: reading never fails on a field of the wrong type (it
becomes unknown) and keeps fields it does not know in ``extra`` so that rewriting loses nothing.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diagnostics.files import write_text_atomic

RUN_JSON = "run.json"

# Outcome fields: absent from the file until the run sets them (a reader tells "not yet" from "none").
_WRITTEN_WHEN_SET = frozenset(
    {
        "wall_time_s",
        "result",
        "levers",
        "result_gap_to_floor",
        "nonfinite",
        "hf_export",
        "prediction",
        "failure",
        "failed_rank",
        "exception",
        "step",
        "phase",
        "hung_ranks",
        "tokenizer_sha256",
    }
)


@dataclass
class RunManifest:
    """What ran, where, on what, and what came out. On the writing side the layout fields hold the run's own
    dataclasses (hw profile, world layout, batch plan, result); read back they are plain dicts."""

    status: str = "running"  # running | completed | stopped | pruned (by a sweep's pruner) | failed
    command: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config, credentials redacted
    hw: Any = None
    world: Any = None  # num_nodes, devices_per_node, world_size, data_parallel_size
    batch: Any = None  # the batch plan: micro, accumulation, global batch
    num_parameters: int | None = None
    flops_per_token: float | None = None
    # The run's unit of work and what its module is: {"unit": "token" | "sample", "lightning_module": bool,
    # "automatic_optimization": bool, "tokens_per_sample": int | None}; the levers a recommendation may use read it.
    work: dict[str, Any] | None = None
    # The trainer's lever catalogue: one {key, lever, changes, keeps_math} per config key a recommendation may set
    # (disttrain.config.levers), so a copied run dir says which keys its trainer took as levers.
    levers: list[dict[str, Any]] | None = None
    versions: dict[str, str] = field(default_factory=dict)
    git: dict[str, Any] | None = None
    resumed_from: str | None = None
    restart_attempt: int = 0
    # Every attempt so far: its world size, global batch and accumulation (an elastic restart changes the world).
    attempts: list[dict[str, Any]] = field(default_factory=list)
    # data=hf: a digest of the tokenizer's files, so a resume can tell a changed tokenizer of the same size
    tokenizer_sha256: str | None = None
    strategy_resolved: Any = None  # strategy=auto's choice (else the configured strategy)
    wall_time_s: float | None = None
    result: Any = None  # steps, losses, tokens/s, memory
    result_gap_to_floor: float | None = None
    nonfinite: dict[str, Any] | None = None  # the non-finite guard's record: policy, skipped steps, stop
    hf_export: str | None = None
    prediction: dict[str, Any] | None = None  # the planner's numbers beside the measured ones
    failure: str | None = None  # one line: which rank raised, died or hung, and how
    failed_rank: int | None = None
    exception: str | None = None  # the failed rank's exception type
    step: int | None = None  # the step and phase it failed in
    phase: str | None = None
    pruned_at_step: int | None = None  # status pruned: the validation step at which the sweep's pruner stopped it
    hung_ranks: list[int] | None = None  # set when the hang watchdog ended the run: the ranks outside collectives
    extra: dict[str, Any] = field(default_factory=dict)  # fields this version does not know, kept as read

    @property
    def recorded(self) -> bool:
        """Whether the run has been built and recorded (before that only a failure can be written)."""
        return bool(self.config)

    @property
    def world_size(self) -> int | None:
        value = _get(self.world, "world_size")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def failed(self, failure: str, rank: int | None, **details: Any) -> RunManifest:
        """This manifest marked failed (a copy: the running record stays as it was)."""
        return dataclasses.replace(self, status="failed", failure=failure, failed_rank=rank, **details)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for spec in dataclasses.fields(self):
            if spec.name == "extra":
                continue
            value = getattr(self, spec.name)
            if value is None and spec.name in _WRITTEN_WHEN_SET:
                continue
            out[spec.name] = to_jsonable(value)
        return {**to_jsonable(self.extra), **out}

    def write(self, run_dir: Path) -> None:
        write_text_atomic(Path(run_dir) / RUN_JSON, json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunManifest:
        """Tolerant: a field of an unexpected type reads as unknown, unknown fields go to ``extra``."""
        known = {spec.name: spec for spec in dataclasses.fields(cls) if spec.name != "extra"}
        values: dict[str, Any] = {}
        for name, value in data.items():
            if name in known and _fits(name, value):
                values[name] = value
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**values, extra=extra)


def read_manifest(run_dir: Path) -> tuple[RunManifest | None, str | None]:
    """``RUN_DIR/run.json``, or None and why not."""
    path = Path(run_dir) / RUN_JSON
    if not path.is_file():
        return None, "no run.json: config context (current values, A/B base) is unknown"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        return None, f"run.json is unreadable ({err}); config context is unknown"
    if not isinstance(data, dict):
        return None, "run.json is not a JSON object"
    return RunManifest.from_json(data), None


def to_jsonable(value: Any) -> Any:
    """Dataclasses, paths and tuples as JSON values (the writing side holds the run's own objects)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def _get(value: Any, key: str) -> Any:
    return value.get(key) if isinstance(value, dict) else getattr(value, key, None)


_DICTS = {"config", "versions", "git", "nonfinite", "prediction", "work"}
_INTS = {"num_parameters", "restart_attempt", "failed_rank", "step"}
_STRS = {"status", "resumed_from", "hf_export", "failure", "exception", "phase", "tokenizer_sha256"}
_NUMBERS = {"flops_per_token", "wall_time_s", "result_gap_to_floor"}


def _fits(name: str, value: Any) -> bool:
    if value is None:
        return name not in {"status", "command", "config", "versions", "restart_attempt"}
    if name in _DICTS:
        return isinstance(value, dict)
    if name in _INTS:
        return isinstance(value, int) and not isinstance(value, bool)
    if name in _STRS:
        return isinstance(value, str)
    if name in _NUMBERS:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if name in ("command", "hung_ranks", "attempts", "levers"):
        return isinstance(value, list)
    return True  # hw, world, batch, result, strategy_resolved: any JSON value, read with _get
