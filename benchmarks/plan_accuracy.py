"""How close the planner's prediction for a run is to what the run measures, per layout, on this machine.

Each layout of the default model runs with the diagnostics on (so it calibrates at start-up: matmul rate, memory
bandwidth, the bus bandwidth of each collective); run.json then holds the planner's prediction with those measured
speeds beside the measurement. Layouts are interleaved per repeat; the table shows the median over repeats of
each error (predicted / measured - 1) with its spread. Target (issue: close the loop): step time within +-15%.

    python benchmarks/plan_accuracy.py                      # ddp, fsdp, deepspeed-2, megatron tp2, megatron pp2
    python benchmarks/plan_accuracy.py --repeats 3 --steps 80
    python benchmarks/plan_accuracy.py --layouts ddp fsdp --extra model.n_layers=2 model.d_model=128
    python benchmarks/plan_accuracy.py --keep DIR           # keep every run dir (DIR/<layout>-<n>/)
    python benchmarks/plan_accuracy.py --from DIR           # re-predict kept runs with today's planner, no training

``--from`` re-reads each kept run's config and start-up calibration records and predicts its layout again, against
the measurement the run recorded: a change to the planner's model is judged on the very same measurements.

hw=cpu has no datasheet numbers: without calibration nothing but memory can be predicted here (run.json says so).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cli import train_manifest

LAYOUTS = {
    "ddp": ["strategy=ddp"],
    "fsdp": ["strategy=fsdp"],
    "deepspeed-2": ["strategy=deepspeed", "strategy.stage=2"],
    "megatron-tp2": ["strategy=megatron", "strategy.tp=2"],
    "megatron-pp2": ["strategy=megatron", "strategy.pp=2"],
}
QUANTITIES = ("step_time_s", "comm_s", "state_bytes", "tokens_per_s")
TARGET = 0.15


def cpu_share(run_dir: Path) -> float | None:
    """Median over the ranks' telemetry samples of each rank's CPU use (its threads' CPU time over wall time, in
    cores): what the host left the run. Near 1 per rank on a quiet box (a rank per core, less its waits); far below
    on a loaded one, where every wall-clock figure stretches by about its inverse."""
    shares = []
    for path in (run_dir / "telemetry").glob("rank*.jsonl"):
        for line in path.read_text(errors="replace").splitlines():
            if '"sample"' in line:
                record = json.loads(line)
                if isinstance(record.get("cpu_util_pct"), int | float):
                    shares.append(record["cpu_util_pct"] / 100)
    return statistics.median(shares) if shares else None


def probe_share(run_dir: Path) -> float | None:
    """Median over ranks of the CPU their parts probe got at start-up (cores): the step's prediction carries that
    moment's host share, so an error follows the change from it to the run's ``cpu_share``."""
    shares = []
    for path in (run_dir / "telemetry").glob("rank*.jsonl"):
        for line in path.read_text(errors="replace").splitlines():
            if '"parts_calibration"' in line:
                record = json.loads(line)
                if isinstance(record.get("cpu_share"), int | float):
                    shares.append(record["cpu_share"])
    return statistics.median(shares) if shares else None


def one_run(layout: str, steps: int, extra: list[str], keep: Path | None = None) -> dict:
    overrides = [
        *LAYOUTS[layout],
        f"trainer.max_steps={steps}",
        f"trainer.val_every_n_steps={steps}",
        "trainer.val_batches=1",
        f"trainer.ckpt_every_n_steps={steps}",
        "trainer.global_batch_size=32",  # the same global batch for every layout (Megatron tp2 has dp=1)
        *extra,
    ]
    share: list[float | None] = []
    probe: list[float | None] = []

    def inspect(run_dir: Path) -> None:
        share.append(cpu_share(run_dir))
        probe.append(probe_share(run_dir))
        if keep is not None:  # the run dirs, for python -m diagnose and the profiler traces
            shutil.copytree(run_dir, keep / f"{layout}-{len(list(keep.glob(layout + '-*')))}")

    prediction = train_manifest(overrides, inspect).get("prediction") or {}
    return {**prediction, "cpu_share": share[0] if share else None, "probe_share": probe[0] if probe else None}


def repredicted(run_dir: Path) -> dict:
    """A kept run's prediction made again by today's planner from its config and calibration records, against the
    measurement it recorded (run.json), with the CPU share it got."""
    from omegaconf import OmegaConf

    from diagnostics.calibration import calibration_from_telemetry
    from disttrain.config.parse import parse_run_config
    from disttrain.job.prediction import predict_run, with_measurement
    from disttrain.strategies.layout import parallel_layout

    cfg = parse_run_config(OmegaConf.load(run_dir / "config.yaml"))
    recorded = json.loads((run_dir / "run.json").read_text()).get("prediction") or {}
    record = predict_run(cfg, parallel_layout(cfg), calibration_from_telemetry(run_dir)) or {}
    measured = recorded.get("measured") or {}
    return {**with_measurement(record, measured), "cpu_share": cpu_share(run_dir), "probe_share": probe_share(run_dir)}


def kept_runs(directory: Path, layouts: list[str]) -> list[tuple[str, Path]]:
    """(layout, run dir) of every ``--keep`` copy under ``directory``, in the order they ran."""
    runs = []
    for name in layouts:
        for path in directory.glob(f"{name}-*"):
            if path.name[len(name) + 1 :].isdigit() and (path / "run.json").is_file():
                runs.append((int(path.name[len(name) + 1 :]), name, path))
    return [(name, path) for _, name, path in sorted(runs)]


def share_adjusted(error: float | None, probe: float | None, run: float | None) -> float | None:
    """The step-time error had the run got the CPU share its parts probe got at start-up: the prediction carries
    the probe's share (wall-clock parts), so ``(1 + error) x probe / run - 1`` takes the host's change out (all of
    the step scaled alike: an approximation; a pipeline rank's share also drops in its bubble, so there it
    over-corrects). A diagnostic of the model apart from the host, not a prediction."""
    if error is None or not probe or not run:
        return None
    return (1 + error) * probe / run - 1


def median_and_spread(values: list[float]) -> str:
    mid = statistics.median(values)
    return f"{mid:+.0%} ({min(values):+.0%}..{max(values):+.0%})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--extra", nargs="*", default=[], help="extra `python -m train` overrides for every run")
    parser.add_argument("--keep", type=Path, help="copy every run dir here (layout-N/)")
    parser.add_argument("--from", dest="source", type=Path, help="re-predict the runs kept in this directory")
    args = parser.parse_args()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    if args.source is not None:
        runs = kept_runs(args.source, args.layouts)
        if not runs:
            sys.exit(f"plan_accuracy: no kept runs (<layout>-<n>/run.json) under {args.source}")
        # Every run stands on its own: one "repeat" per kept run, in the order they ran.
        schedule = [[(name, path)] for name, path in runs]
    else:
        schedule = [
            [(name, None) for name in args.layouts[r % len(args.layouts) :] + args.layouts[: r % len(args.layouts)]]
            for r in range(args.repeats)
        ]
    errors: dict[str, dict[str, list[float]]] = {name: {q: [] for q in QUANTITIES} for name in args.layouts}
    examples: dict[str, dict] = {}
    loads: list[float] = []
    shares: list[float | None] = []
    for repeat, order in enumerate(schedule):
        for name, kept in order:
            record = repredicted(kept) if kept is not None else one_run(name, args.steps, args.extra, args.keep)
            examples[name] = record
            for q, e in (record.get("error") or {}).items():
                if q in errors[name]:
                    errors[name][q].append(e)
            step = (record.get("error") or {}).get("step_time_s")
            shown = "n/a" if step is None else f"{step:+.1%}"
            adjusted = share_adjusted(step, record.get("probe_share"), record.get("cpu_share"))
            if adjusted is not None:
                errors[name].setdefault("share_adjusted", []).append(adjusted)
                shown += f", {adjusted:+.1%} with the host-share change taken out"
            if kept is None:
                loads.append(os.getloadavg()[0])  # timing figures are only as good as the host is quiet
            share = record.get("cpu_share")
            shares.append(share)
            share_text = "n/a" if share is None else f"{share:.2f}"
            if record.get("probe_share") is not None:
                share_text += f", at the parts probe {record['probe_share']:.2f}"
            where = f"load {loads[-1]:.1f}, " if kept is None else f"{kept.name}, "
            print(
                f"  repeat {repeat + 1} {name}: step-time error {shown} ({where}CPU per rank {share_text} cores)",
                flush=True,
            )
    header = f"{'layout':<14}" + "".join(f"{q:>26}" for q in QUANTITIES) + "  predicted / measured step (last run)"
    print("\nmedian error (min..max) over repeats, predicted / measured - 1:")
    print(header)
    met = 0
    for name in args.layouts:
        cells = [median_and_spread(errors[name][q]) if errors[name][q] else "n/a" for q in QUANTITIES]
        record = examples.get(name) or {}
        p, m = (record.get("predicted") or {}), (record.get("measured") or {})
        last = f"{p.get('step_time_s', 0) * 1e3:.0f} ms / {m.get('step_time_s', 0) * 1e3:.0f} ms"
        print(f"{name:<14}" + "".join(f"{c:>26}" for c in cells) + f"  {last}")
        step = errors[name]["step_time_s"]
        met += bool(step) and abs(statistics.median(step)) <= TARGET
        if adjusted_errors := errors[name].get("share_adjusted"):
            print(f"{'':<14}  with the host-share change taken out: {median_and_spread(adjusted_errors)}")
    basis = next(iter(examples.values()), {}).get("basis")
    print(f"\nhw numbers: {basis}")
    if loads:
        span = f"{min(loads):.1f}..{max(loads):.1f}"
        print(f"host load (1-minute average) as each run ended: {span}, {os.cpu_count()} cores")
    known = [s for s in shares if s is not None]
    if known:
        print(f"CPU per rank (median of its samples, cores): {min(known):.2f}..{max(known):.2f}")
    print(f"step time within +-{TARGET:.0%}: {met} of {len(args.layouts)} layouts")


if __name__ == "__main__":
    main()
