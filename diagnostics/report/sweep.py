"""The sweep report: every run of a Hydra multirun side by side (``MULTIRUN_DIR/report/sweep.{md,html,json}``).

Read from the run directories alone (``.hydra/overrides.yaml``, ``run.json``, ``report/report.json``,
``failure.json``, ``attempts.jsonl``), so it works on a sweep copied off a cluster: per run the overrides, final
loss, tokens/s, MFU, peak memory and top bottleneck; runs ranked by final loss; the Pareto front of tokens/s
against peak memory; scaling efficiency where runs differ only in world size; failed runs with their error.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from diagnostics.manifest import RunManifest, read_manifest
from diagnostics.report.fmt import peak_memory
from diagnostics.report.sweep_study import StudySummary, read_study

SWEEP_REPORT_DIR = "report"
# Overrides that only change how many processes run: runs differing in nothing else form a scaling series.
WORLD_KEYS = ("hw", "hw.num_nodes", "hw.devices_per_node")
STATUS_ORDER = ("completed", "pruned", "stopped", "running", "screened", "failed")
# Overrides the Optuna sweeper adds to link a job to its trial: shown as the trial number, never as a varying key.
TRIAL_KEYS = ("trial.storage", "trial.study", "trial.number")


@dataclass
class SweepRun:
    name: str  # the job's directory, relative to the sweep dir
    overrides: dict[str, str]
    # completed | pruned (by the sweep's pruner) | stopped | running (no result and no failure: still going, or
    # killed) | screened (the memory check refused its config: never launched; error says why) | failed
    status: str
    error: str | None = None
    error_detail: str | None = None  # traceback or SLURM's account of the failure (tail)
    train_loss: float | None = None
    val_loss: float | None = None
    steps: int | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    mfu_basis: str | None = None  # datasheet | calibrated
    peak_memory_bytes: float | None = None
    peak_memory_kind: str | None = None
    world_size: int | None = None
    top_finding: str | None = None
    attempts: int = 1
    has_report: bool = False
    prediction: dict[str, Any] | None = None  # run.json's planner prediction with measured values and errors
    trial: int | None = None  # the Optuna trial (hydra/sweeper=optuna)
    pruned_at_step: int | None = None
    unit: str = "token"  # what tokens_per_s counts: "sample" for a LightningModule's run (its rate is samples/s)

    @property
    def final_loss(self) -> float | None:
        return self.val_loss if self.val_loss is not None else self.train_loss


@dataclass
class ScalingPoint:
    run: str
    world_size: int
    tokens_per_s: float
    speedup: float  # tokens/s over the smallest world size's
    efficiency: float  # speedup / (world size ratio)


@dataclass
class ScalingSeries:
    fixed: dict[str, str]  # the overrides every run of the series shares
    points: list[ScalingPoint]


@dataclass
class SweepReport:
    sweep_dir: Path
    runs: list[SweepRun]  # ranked: completed by final loss (then tokens/s), then the rest, failed last
    varying: list[str]  # override keys whose value differs between runs
    pareto: list[str] = field(default_factory=list)  # run names on the tokens/s vs memory front, by memory
    scaling: list[ScalingSeries] = field(default_factory=list)
    study: StudySummary | None = None  # hydra/sweeper=optuna: the study's trials, best, screened-out trials
    written_to: Path | None = None

    def label(self, run: SweepRun) -> str:
        """The run by what varies in the sweep (``optimizer.lr=1e-4 strategy=fsdp``), else its dir name."""
        parts = [f"{k}={run.overrides[k]}" for k in self.varying if k in run.overrides]
        return " ".join(parts) or run.name

    @property
    def rate_label(self) -> str:
        """The runs' throughput unit: tokens/s, samples/s (LightningModules' runs), or both where they mix."""
        units = {r.unit for r in self.runs} or {"token"}
        return " or ".join(f"{unit}s/s" for unit in sorted(units))

    @property
    def failed(self) -> list[SweepRun]:
        return [r for r in self.runs if r.status == "failed"]

    def to_json(self) -> dict[str, Any]:
        return {
            "sweep_dir": str(self.sweep_dir),
            "varying": self.varying,
            "runs": [{**asdict(r), "final_loss": r.final_loss, "label": self.label(r)} for r in self.runs],
            "pareto_front": self.pareto,
            "scaling": [asdict(s) for s in self.scaling],
            "failed": [r.name for r in self.failed],
            "study": asdict(self.study) if self.study is not None else None,
        }

    def text_summary(self) -> str:
        done = sum(r.status == "completed" for r in self.runs)
        counts = [f"{done} completed"]
        for status in ("pruned", "screened"):
            if n := sum(r.status == status for r in self.runs):
                counts.append(f"{n} {status}")
        counts.append(f"{len(self.failed)} failed")
        lines = [f"sweep: {len(self.runs)} runs, {', '.join(counts)} ({self.sweep_dir})"]
        best = next((r for r in self.runs if r.status == "completed" and r.final_loss is not None), None)
        if best is not None:
            lines.append(f"  best final loss {best.final_loss:.4f}: {self.label(best)} ({best.name})")
        for run in self.failed:
            lines.append(f"  failed: {self.label(run)} ({run.name}): {run.error}")
        if self.written_to is not None:
            lines.append(f"sweep report: {self.written_to / 'sweep.html'} (also sweep.md, sweep.json)")
        return "\n".join(lines)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def parse_overrides(lines: list[str]) -> dict[str, str]:
    """``["+model.x=1", "hw=cpu"]`` -> ``{"model.x": "1", "hw": "cpu"}`` (Hydra's own override strings)."""
    out = {}
    for line in lines:
        key, _, value = str(line).partition("=")
        out[key.lstrip("+~")] = value
    return out


def is_run_dir(path: Path) -> bool:
    return any((path / marker).exists() for marker in ("run.json", ".hydra/overrides.yaml", "failure.json"))


def find_runs(sweep_dir: Path) -> list[Path]:
    """Job directories under ``sweep_dir`` (Hydra's subdirs, possibly nested), skipping submitit's and reports."""
    found = []
    for path in sorted(sweep_dir.rglob("*")):
        if not path.is_dir() or any(part.startswith(".") for part in path.relative_to(sweep_dir).parts):
            continue
        if is_run_dir(path) and not any(parent in found for parent in path.parents):
            found.append(path)
    return found


def load_run(sweep_dir: Path, run_dir: Path) -> SweepRun:
    manifest = read_manifest(run_dir)[0] or RunManifest()
    failure = _read_json(run_dir / "failure.json")
    report = _read_json(run_dir / "report" / "report.json")
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    lines = yaml.safe_load(overrides_file.read_text()) if overrides_file.is_file() else None
    if lines is None:
        lines = (failure or {}).get("overrides") or []
    overrides = parse_overrides(lines)
    trial = overrides.get("trial.number")
    overrides = {k: v for k, v in overrides.items() if k not in TRIAL_KEYS}
    run = SweepRun(name=str(run_dir.relative_to(sweep_dir)), overrides=overrides, status="running")
    run.trial = int(trial) if trial is not None and trial.isdigit() else None
    result = manifest.result if isinstance(manifest.result, dict) else {}
    run.train_loss, run.val_loss = result.get("train_loss"), result.get("val_loss")
    run.steps, run.tokens_per_s = result.get("steps"), result.get("tokens_per_s")
    if isinstance(manifest.work, dict) and manifest.work.get("unit") == "sample":  # a LightningModule's run
        metrics = result.get("metrics")
        logged: dict[str, Any] = metrics if isinstance(metrics, dict) else {}
        run.unit, run.tokens_per_s = "sample", result.get("samples_per_s")
        run.train_loss, run.val_loss = logged.get("train_loss"), logged.get("val_loss")
    run.world_size = manifest.world_size
    if result.get("measured_memory_bytes"):
        run.peak_memory_bytes, run.peak_memory_kind = result["measured_memory_bytes"], result.get("memory_kind")
    run.prediction = manifest.prediction
    if report is not None:
        _apply_report(run, report)
    attempts = run_dir / "attempts.jsonl"
    if attempts.is_file():
        starts = sum('"event": "start"' in line for line in attempts.read_text(encoding="utf-8").splitlines())
        run.attempts = max(1, starts)
    status = manifest.status
    if failure is not None or status == "failed":
        run.status = "failed"
        run.error = (failure or {}).get("error") or manifest.failure or "failed (no error recorded)"
        detail = (failure or {}).get("traceback") or ""
        run.error_detail = detail.strip()[-2000:] or None
    elif status in ("completed", "stopped", "pruned"):
        run.status = status
        run.pruned_at_step = manifest.pruned_at_step
    return run


def _apply_report(run: SweepRun, report: dict[str, Any]) -> None:
    run.has_report = True
    summary = report.get("summary") or {}
    run.tokens_per_s = summary.get("tokens_per_s") or summary.get("samples_per_s") or run.tokens_per_s
    run.world_size = summary.get("world_size") or run.world_size
    if summary.get("mfu") is not None:
        run.mfu, run.mfu_basis = summary["mfu"], "datasheet"
    elif summary.get("calibrated_mfu") is not None:
        run.mfu, run.mfu_basis = summary["calibrated_mfu"], "calibrated"
    label, peak = peak_memory(summary.get("peak_memory") or {})
    if peak:
        run.peak_memory_bytes, run.peak_memory_kind = peak, label
    if isinstance(report.get("prediction"), dict):
        run.prediction = report["prediction"]
    findings = report.get("findings") or []
    if findings:
        top = findings[0]
        run.top_finding = f"{top.get('severity')} {top.get('kind')}: {top.get('message')}"


def rank_runs(runs: list[SweepRun]) -> list[SweepRun]:
    def key(run: SweepRun) -> tuple:
        loss = run.final_loss if run.final_loss is not None else float("inf")
        return STATUS_ORDER.index(run.status), loss, -(run.tokens_per_s or 0.0), run.name

    return sorted(runs, key=key)


def varying_keys(runs: list[SweepRun]) -> list[str]:
    keys = sorted({k for r in runs for k in r.overrides})
    return [k for k in keys if len({r.overrides.get(k) for r in runs}) > 1]


def pareto_front(runs: list[SweepRun]) -> list[str]:
    """Completed runs no other run beats on both tokens/s (higher) and peak memory (lower), by memory."""
    points = [r for r in runs if r.status == "completed" and r.tokens_per_s and r.peak_memory_bytes]

    def dominated(r: SweepRun) -> bool:
        return any(
            o.tokens_per_s >= r.tokens_per_s  # type: ignore[operator]
            and o.peak_memory_bytes <= r.peak_memory_bytes  # type: ignore[operator]
            and (o.tokens_per_s > r.tokens_per_s or o.peak_memory_bytes < r.peak_memory_bytes)  # type: ignore[operator]
            for o in points
        )

    return [r.name for r in sorted(points, key=lambda r: r.peak_memory_bytes or 0.0) if not dominated(r)]


def scaling_series(runs: list[SweepRun]) -> list[ScalingSeries]:
    """Runs equal in every override but the world size: speedup and efficiency against the smallest world."""
    groups: dict[tuple, list[SweepRun]] = {}
    for run in runs:
        if run.status == "completed" and run.tokens_per_s and run.world_size:
            fixed = tuple(sorted((k, v) for k, v in run.overrides.items() if k not in WORLD_KEYS))
            groups.setdefault(fixed, []).append(run)
    series = []
    for fixed, members in groups.items():
        if len({r.world_size for r in members}) < 2:
            continue
        members.sort(key=lambda r: (r.world_size, r.name))
        base = members[0]
        points = []
        for r in members:
            speedup = r.tokens_per_s / base.tokens_per_s  # type: ignore[operator]
            efficiency = speedup / (r.world_size / base.world_size)  # type: ignore[operator]
            points.append(ScalingPoint(r.name, r.world_size, r.tokens_per_s, speedup, efficiency))  # type: ignore[arg-type]
        series.append(ScalingSeries(dict(fixed), points))
    return series


def screened_runs(study: StudySummary) -> list[SweepRun]:
    """The trials the memory check refused: no run dir, their sampled values and the reason from the study."""
    return [
        SweepRun(
            name=f"trial {t.number}",
            overrides={k: str(v) for k, v in t.params.items()},
            status="screened",
            error=t.reason,
            trial=t.number,
        )
        for t in study.screened
    ]


def build_sweep_report(sweep_dir: Path, storage: str | None = None) -> SweepReport:
    """Everything the sweep dir (and its Optuna study, if any: ``storage`` overrides where it is) holds about its
    runs (FileNotFoundError when it holds no run at all)."""
    sweep_dir = Path(sweep_dir)
    dirs = find_runs(sweep_dir)
    study = read_study(sweep_dir, storage)
    if not dirs and (study is None or not study.screened):
        raise FileNotFoundError(f"no runs under {sweep_dir} (no run.json, .hydra/overrides.yaml or failure.json)")
    runs = [load_run(sweep_dir, d) for d in dirs] + (screened_runs(study) if study is not None else [])
    runs = rank_runs(runs)
    return SweepReport(sweep_dir, runs, varying_keys(runs), pareto_front(runs), scaling_series(runs), study)
