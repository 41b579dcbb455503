"""Read a run directory's telemetry (and its manifest, when present) into typed, per-rank records.

Robust by design: a rank killed mid-write leaves a torn last line, a rank that died early leaves no file, a
collector of an older or newer version writes fields this reader does not know or leaves out fields it does.
Every such gap becomes a ``problems`` line in the report instead of an exception.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diagnostics.crash import read_crash_records
from diagnostics.manifest import RunManifest, read_manifest
from diagnostics.telemetry import TELEMETRY_DIR

RANK_FILE = re.compile(r"^rank(\d+)\.jsonl$")
SAMPLE_NUMBERS = (
    "util_pct", "mem_used_bytes", "mem_total_bytes", "power_w", "sm_clock_mhz", "temp_c", "cpu_util_pct", "rss_bytes",
    "power_limit_w", "default_power_limit_w",
)  # fmt: skip


def num(value: Any) -> float | None:
    """A finite float from a JSON value, or None (missing, null, bool, text, NaN, inf)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None


@dataclass(frozen=True)
class StepRecord:
    step: int
    step_s: float | None
    data_wait_s: float | None = None
    data_cpu_s: float | None = None  # the training thread's CPU time inside data wait (newer collectors)
    forward_s: float | None = None
    backward_s: float | None = None
    optimizer_s: float | None = None
    local_compute_s: float | None = None
    comm_wait_s: float | None = None
    tokens: float | None = None
    bubble_fraction: float | None = None  # pipeline schedules only; not in every collector version
    start_t: float | None = None  # unix time the step started on this rank's host; not in every collector version
    # Time inside collectives a phase issued itself (FSDP2's all-gathers/reduce-scatters), part of forward_s and
    # of backward_s before the comm wait; only where the collector timed them.
    forward_comm_s: float | None = None
    backward_comm_s: float | None = None
    optimizer_comm_s: float | None = None  # ZeRO-3's optimizer-step collectives, part of optimizer_s
    # Of those, expert parallelism's token all-to-alls (MoE dispatch and combine, forward and backward).
    all_to_all_s: float | None = None
    # The same collectives' seconds call by call, in the order the rank issued them (analysis/phase_comm).
    comm_calls_s: list[float] | None = None
    all_to_all_calls_s: list[float] | None = None
    # Positions in all_to_all_calls_s of the exchanges that end the experts' compute (None: not recorded).
    all_to_all_after_experts: list[int] | None = None


@dataclass(frozen=True)
class RanksWindow:
    """Rank 0's all-gathered view of every rank over a window of steps (lists indexed by rank)."""

    step: int
    window_steps: int | None
    local_compute_s: list[float | None]
    step_s: list[float | None]
    data_wait_s: list[float | None]


@dataclass(frozen=True)
class Sample:
    t: float
    source: str  # nvml | cpu
    device_index: int | None
    util_pct: float | None
    mem_used_bytes: float | None
    mem_total_bytes: float | None
    power_w: float | None
    sm_clock_mhz: float | None
    temp_c: float | None
    throttle_reasons: Any
    cpu_util_pct: float | None
    rss_bytes: float | None
    power_limit_w: float | None = None  # the enforced power limit (NVML), absent from older telemetry
    default_power_limit_w: float | None = None  # the board's default limit: an enforced one below it was lowered


@dataclass(frozen=True)
class ProfileWindow:
    steps: int | None  # how many optimizer steps the window spans
    total_s: float | None
    compute_s: float | None
    comm_s: float | None
    overlap_s: float | None
    idle_s: float | None
    comm_by_op: dict[str, float]
    trace_file: str | None
    backend: str | None


@dataclass
class RankTelemetry:
    """Everything one rank wrote; the single-record kinds keep their last occurrence."""

    rank: int
    meta: dict[str, Any] | None = None
    steps: list[StepRecord] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    profiles: list[ProfileWindow] = field(default_factory=list)
    memory: dict[str, Any] | None = None
    throughput: dict[str, Any] | None = None
    calibrations: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    hang: dict[str, Any] | None = None
    nonfinite: list[dict[str, Any]] = field(default_factory=list)  # the non-finite guard's verdicts, in order
    # Mixture-of-experts models: which experts this rank computes (once), and per step the assignments routed
    # from this rank's tokens and dropped, per layer and expert (collect/experts.py).
    expert_layout: dict[str, Any] | None = None
    experts: list[dict[str, Any]] = field(default_factory=list)
    # Validation and checkpoint writes, each {"what", "step", "seconds", "start_t"} (collect/steps.Pause).
    pauses: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    first_t: float | None = None
    flops_count: dict[str, Any] | None = None  # a LightningModule's FLOPs per unit, counted at its first step


@dataclass
class RunTelemetry:
    run_dir: Path
    ranks: dict[int, RankTelemetry]
    windows: list[RanksWindow]
    manifest: RunManifest | None
    overrides: list[str] | None
    problems: list[str]
    crashes: dict[int, dict[str, Any]] = field(default_factory=dict)  # failure_rank<N>.json records by rank

    @property
    def world_size(self) -> int:
        """Expected number of ranks: from the collectors' meta, else the manifest, else the files found."""
        for tele in self.ranks.values():
            if tele.meta and isinstance(tele.meta.get("world_size"), int):
                return tele.meta["world_size"]
        if self.manifest is not None and self.manifest.world_size is not None:
            return self.manifest.world_size
        return max(self.ranks, default=-1) + 1

    @property
    def work_unit(self) -> str:
        """What the run's ``tokens_*`` figures count: "token", or "sample" for a LightningModule's run."""
        return str(self.meta("work_unit") or "token")

    def meta(self, key: str) -> Any:
        """A meta field from the lowest rank that reported it."""
        for rank in sorted(self.ranks):
            value = (self.ranks[rank].meta or {}).get(key)
            if value is not None:
                return value
        return None


def _step(rec: dict[str, Any]) -> StepRecord | None:
    step = rec.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    keys = ("data_wait_s", "data_cpu_s", "forward_s", "backward_s", "optimizer_s", "local_compute_s", "comm_wait_s",
            "tokens", "forward_comm_s", "backward_comm_s", "optimizer_comm_s", "all_to_all_s")  # fmt: skip
    return StepRecord(
        step=step,
        step_s=num(rec.get("step_s")),
        bubble_fraction=num(rec.get("bubble_fraction")),
        start_t=num(rec.get("start_t")),
        comm_calls_s=_calls(rec.get("comm_calls_s")),
        all_to_all_calls_s=_calls(rec.get("all_to_all_calls_s")),
        all_to_all_after_experts=_positions(rec.get("all_to_all_after_experts")),
        **{k: num(rec.get(k)) for k in keys},
    )


def _positions(value: Any) -> list[int] | None:
    """A list of non-negative list positions, or None where it is missing or malformed."""
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return None
    return list(value)


def _calls(value: Any) -> list[float] | None:
    """A list of call durations, or None where it is missing or any entry is not a number."""
    if not isinstance(value, list):
        return None
    calls = [num(v) for v in value]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]


def _num_list(value: Any) -> list[float | None]:
    return [num(v) for v in value] if isinstance(value, list) else []


def _window(rec: dict[str, Any]) -> RanksWindow | None:
    local = _num_list(rec.get("local_compute_s"))
    if not local:
        return None
    steps = rec.get("window_steps")
    return RanksWindow(
        step=step if isinstance(step := rec.get("step"), int) else -1,
        window_steps=steps if isinstance(steps, int) else None,
        local_compute_s=local,
        step_s=_num_list(rec.get("step_s")),
        data_wait_s=_num_list(rec.get("data_wait_s")),
    )


def _sample(rec: dict[str, Any]) -> Sample:
    index = rec.get("device_index")
    return Sample(
        t=num(rec.get("t")) or 0.0,
        source=str(rec.get("source") or "unknown"),
        device_index=index if isinstance(index, int) else None,
        throttle_reasons=rec.get("throttle_reasons"),
        **{k: num(rec.get(k)) for k in SAMPLE_NUMBERS},
    )


def _profile(rec: dict[str, Any]) -> ProfileWindow:
    by_op = found if isinstance(found := rec.get("comm_by_op"), dict) else {}
    steps = rec.get("steps")
    if isinstance(steps, list) and len(steps) == 2 and all(isinstance(s, int) for s in steps):
        steps = steps[1] - steps[0] + 1  # [first, last] step of the window
    return ProfileWindow(
        steps=steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None,
        comm_by_op={str(k): seconds for k, v in by_op.items() if (seconds := num(v)) is not None},
        trace_file=str(rec["trace_file"]) if rec.get("trace_file") else None,
        backend=str(rec["backend"]) if rec.get("backend") else None,
        **{k: num(rec.get(k)) for k in ("total_s", "compute_s", "comm_s", "overlap_s", "idle_s")},
    )


def _add(tele: RankTelemetry, rec: dict[str, Any], windows: list[RanksWindow]) -> None:
    kind = rec.get("kind")
    t = num(rec.get("t"))
    if t is not None and (tele.first_t is None or t < tele.first_t):
        tele.first_t = t
    if kind == "step" and (step := _step(rec)) is not None:
        tele.steps.append(step)
    elif kind == "ranks" and (window := _window(rec)) is not None:
        windows.append(window)
    elif kind == "sample":
        tele.samples.append(_sample(rec))
    elif kind == "profile":
        tele.profiles.append(_profile(rec))
    elif kind == "calibration":
        tele.calibrations.append(rec)
    elif kind == "error":
        tele.errors.append(rec)
    elif kind == "nonfinite":
        tele.nonfinite.append(rec)
    elif kind == "experts":
        tele.experts.append(rec)
    elif kind == "pause":
        tele.pauses.append(rec)
    elif kind in ("meta", "memory", "throughput", "hang", "end", "expert_layout", "flops_count"):
        setattr(tele, kind, rec)


def read_rank_file(path: Path) -> tuple[list[dict[str, Any]], int, bool]:
    """(records, unreadable lines, whether the last line was torn) of one rank's JSON-lines file."""
    records: list[dict[str, Any]] = []
    bad, torn = 0, False
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            torn = i == len(lines) - 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            bad += 1
    return records, bad, torn


def read_overrides(run_dir: Path) -> list[str] | None:
    """The command-line overrides of the run: Hydra's record, else the argv saved in run.json."""
    record = run_dir / ".hydra" / "overrides.yaml"
    if record.is_file():
        # Hydra writes a plain YAML list of strings, one "- key=value" per line; yaml is only needed for quoting.
        import yaml

        try:
            loaded = yaml.safe_load(record.read_text(encoding="utf-8"))
        except yaml.YAMLError:
            loaded = None
        if isinstance(loaded, list):
            return [str(o) for o in loaded]
    manifest, _ = read_manifest(run_dir)
    command = manifest.command if manifest is not None else None
    if command and len(command) > 1:
        # argv[0] is the interpreter or script; Hydra's own settings are not part of the run's configuration.
        return [str(a) for a in command[2:] if "=" in str(a) and not str(a).lstrip("+~").startswith("hydra.")]
    return None


def load_run(run_dir: Path) -> RunTelemetry:
    """Parse ``RUN_DIR/telemetry/rank*.jsonl``, the ranks' crash records and run.json; raises FileNotFoundError if
    there is neither telemetry nor a crash record (a run that failed before its first step has only the latter)."""
    run_dir = Path(run_dir)
    files = sorted(
        (int(m.group(1)), p) for p in (run_dir / TELEMETRY_DIR).glob("rank*.jsonl") if (m := RANK_FILE.match(p.name))
    )
    crashes = read_crash_records(run_dir)
    if not files and not crashes:
        raise FileNotFoundError(f"no telemetry files in {run_dir / TELEMETRY_DIR}")
    problems: list[str] = []
    ranks: dict[int, RankTelemetry] = {}
    windows: list[RanksWindow] = []
    for file_rank, path in files:
        records, bad, torn = read_rank_file(path)
        tele = ranks.setdefault(file_rank, RankTelemetry(file_rank))
        for rec in records:
            _add(tele, rec, windows)
        if bad:
            where = "a torn last line (the rank was killed mid-write)" if torn and bad == 1 else f"{bad} bad lines"
            problems.append(f"{path.name}: skipped {where}")
    manifest, manifest_problem = read_manifest(run_dir)
    if manifest_problem:
        problems.append(manifest_problem)
    run = RunTelemetry(run_dir, ranks, windows, manifest, read_overrides(run_dir), problems, crashes)
    missing = sorted(set(range(run.world_size)) - set(ranks))
    if missing and files:
        problems.append(f"no telemetry from rank(s) {missing} of {run.world_size}: those ranks never started writing")
    for tele in ranks.values():
        tele.steps.sort(key=lambda s: s.step)
        for err in tele.errors:
            problems.append(f"rank {tele.rank}: collector {err.get('source', '?')} failed: {err.get('message', '')}")
    return run
