"""What diagnostics cost: tokens/s of the same run with ``diagnostics=default`` vs ``diagnostics=off``.

Three arms, interleaved (off, default, default without the profiler window, rotated every repeat so no arm
always runs first) so drift on a shared machine hits all of them; ratios of the medians are printed, each arm
with its spread (min/max off the median) (target >= 0.98, at 120 and at the default 220 steps):

- ``default / off``: the whole cost at this run length, the one-time profiler window included;
- ``no window / off``: the always-on collectors (step phases, rank gathers, sampler, watchdog, telemetry),
  i.e. the cost per step that does not shrink as a run gets longer;
- the profiler window's one-time cost in seconds, measured inside the default runs from their own step
  records (profiled steps minus the median step), and what share of this run's training time it is;
- the always-on collectors' own time on the training thread (timed by the collectors, ``end`` record), as a
  share of step time: the direct figure, free of the drift between runs that the ratios above carry.

    python benchmarks/diagnostics_overhead.py [--steps 120 220] [--repeats 3] [--extra strategy=fsdp ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cli import spread, train_manifest

ARMS = {"off": ["diagnostics=off"], "default": ["diagnostics=default"], "no window": ["diagnostics.profile=false"]}


def run(arm: str, steps: int, extra: list[str]) -> tuple[float, float, tuple[float, float] | None, float | None]:
    """(tokens/s over the run, its median step's seconds, (profiler window's extra seconds, all steps' seconds) on
    rank 0 or None, and the share of rank 0's step time its always-on collectors took on the training thread, or
    None) of one run."""
    overrides = [
        *ARMS[arm],
        f"trainer.max_steps={steps}",
        f"trainer.val_every_n_steps={steps}",
        "trainer.val_batches=1",
        f"trainer.ckpt_every_n_steps={steps}",
        *extra,
    ]
    window: list[tuple[float, float] | None] = [None]
    collectors: list[float | None] = [None]

    def inspect(run_dir: Path) -> None:
        window[0] = window_cost(run_dir / "telemetry" / "rank0000.jsonl")
        collectors[0] = collectors_share(run_dir / "telemetry" / "rank0000.jsonl")

    manifest = train_manifest(overrides, inspect=inspect)
    result = manifest["result"]
    return result["tokens_per_s"], result["step_time_p50_s"], window[0], collectors[0]


def collectors_share(telemetry: Path) -> float | None:
    """The collectors' own time on the training thread (the ``end`` record) over all step time, from rank 0."""
    if not telemetry.exists():
        return None
    records = [json.loads(line) for line in telemetry.read_text().splitlines() if line.strip()]
    own = [r["collectors_s"] for r in records if r.get("kind") == "end" and r.get("collectors_s") is not None]
    total = sum(r["step_s"] for r in records if r.get("kind") == "step" and r.get("step_s"))
    return own[-1] / total if own and total else None


def window_cost(telemetry: Path) -> tuple[float, float] | None:
    """Seconds the profiled steps took beyond the median step, and all steps' seconds, from rank 0's records."""
    if not telemetry.exists():
        return None
    records = [json.loads(line) for line in telemetry.read_text().splitlines() if line.strip()]
    steps = {r["step"]: r["step_s"] for r in records if r.get("kind") == "step" and r.get("step_s")}
    profiles = [r for r in records if r.get("kind") == "profile"]
    if not steps or not profiles:
        return None
    first, last = profiles[0]["steps"]
    typical = statistics.median(steps.values())
    # A step record times from the previous step's end hooks to this one's, and the profiler advances in those
    # hooks after the record is closed: starting and stopping the trace land in the next step's record.
    profiled = [steps[s] for s in range(first, last + 2) if s in steps]
    return sum(t - typical for t in profiled), sum(steps.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, nargs="+", default=[120, 220])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--extra", nargs="*", default=[])
    args = parser.parse_args()
    for steps in args.steps:
        measure(steps, args.repeats, args.extra)


def measure(steps: int, repeats: int, extra: list[str]) -> None:
    rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
    medians: dict[str, list[float]] = {arm: [] for arm in ARMS}  # tokens/s at the median step, relative units
    windows: list[tuple[float, float]] = []
    shares: list[float] = []
    arms = list(ARMS)
    for repeat in range(repeats):
        for arm in arms[repeat % len(arms) :] + arms[: repeat % len(arms)]:
            rate, step_s, window, share = run(arm, steps, extra)
            print(
                f"  {steps} steps, repeat {repeat + 1}, diagnostics {arm}: {rate:,.0f} tokens/s,"
                f" median step {1e3 * step_s:.1f} ms",
                flush=True,
            )
            rates[arm].append(rate)
            medians[arm].append(1.0 / step_s)
            if arm == "default" and window is not None:
                windows.append(window)
            if arm != "off" and share is not None:
                shares.append(share)
    for arm, values in rates.items():
        steady = statistics.median(1.0 / v for v in medians[arm])
        print(
            f"diagnostics {arm:<10}: {statistics.median(values):10,.0f} tokens/s over the run ({spread(values)}),"
            f" median step {1e3 * steady:.1f} ms ({spread(medians[arm])} in rate), {len(values)} runs"
        )
    for label, series in (("whole run", rates), ("median step", medians)):
        for arm, what in (("default", f"{steps} steps"), ("no window", "always-on collectors")):
            of_medians = statistics.median(series[arm]) / statistics.median(series["off"])
            paired = [a / b for a, b in zip(series[arm], series["off"], strict=True)]
            print(
                f"ratio {arm} / off, {label} ({what}; target >= 0.98): {of_medians:.3f} of medians,"
                f" paired {statistics.median(paired):.3f} ({min(paired):.3f}..{max(paired):.3f})"
            )
    if windows:
        seconds = statistics.median(extra for extra, _ in windows)
        share = statistics.median(extra / total for extra, total in windows)
        print(f"profiler window: {seconds:.2f} s once per run, {100 * share:.1f}% of these {steps} steps' time")
    if shares:
        own = statistics.median(shares)
        print(f"always-on collectors on the training thread (measured inside the runs): {100 * own:.2f}% of step time")


if __name__ == "__main__":
    main()
