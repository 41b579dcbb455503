"""Start-up time of a tiny 2-rank ``python -m train`` launch: this checkout against a git rev, arms interleaved.

    python benchmarks/startup.py --baseline main --repeats 5

Each launch trains the tiny model for two steps, so nearly all of its wall time is start-up. Per launch it times,
from outside the process (nothing in the code under test is instrumented):

  spawn   launch -> the first local rank exists (rank 0's preflight, Hydra and, before early_start.py, its imports)
  built   launch -> run.json is written (both ranks imported; rank 0 built the model, trainer and data)
  total   launch -> the launcher exited (+ rendezvous, fit, finish: run.json, the report)

The baseline runs from a ``git worktree`` of the rev with this interpreter, its sources first on PYTHONPATH (the
editable install's finder comes after PYTHONPATH). On a shared machine the absolute seconds move with the load:
compare the arms of the same run, whose repeats are interleaved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.train_cli import spread  # noqa: E402 (needs the repo root on sys.path when run as a script)
from tests.conftest import TINY_MODEL  # noqa: E402

TINY_RUN = [*TINY_MODEL, "trainer.max_steps=2", "diagnostics=off"]  # hw=cpu: 2 local ranks
PHASES = ("spawn", "built", "total")


def children_of(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def launch(source: Path, overrides: list[str], poll_s: float = 0.01) -> dict[str, float]:
    """One launch of ``python -m train`` from ``source``'s code; seconds from the launch to each phase."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if source != REPO:
        env["PYTHONPATH"] = os.pathsep.join(str(source / d) for d in ("", "src", "pipelines"))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "train", *overrides, f"hydra.run.dir={run_dir}"],
            cwd=tmp,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        seen: dict[str, float] = {}
        while proc.poll() is None:
            now = time.monotonic() - start
            if "spawn" not in seen and children_of(proc.pid):
                seen["spawn"] = now
            if "built" not in seen and (run_dir / "run.json").exists():
                seen["built"] = now
            time.sleep(poll_s)
        seen["total"] = time.monotonic() - start
        if proc.returncode != 0:
            raise RuntimeError(f"launch from {source} failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        return seen


def baseline_checkout(rev: str, into: Path) -> Path:
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(into), rev], check=True, capture_output=True
    )
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="main", help="git rev to compare with (none: only this checkout)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    arms = {"current": REPO}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline != "none":
            arms[f"baseline {args.baseline}"] = baseline_checkout(args.baseline, Path(tmp) / "baseline")
        try:
            times: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
            for i in range(args.repeats):
                for name, source in arms.items():  # interleaved: a load change hits both arms alike
                    times[name].append(launch(source, TINY_RUN))
                    print(
                        f"repeat {i + 1} {name:>20}: "
                        + "  ".join(f"{p} {times[name][-1].get(p, float('nan')):5.1f}s" for p in PHASES),
                        flush=True,
                    )
        finally:
            if len(arms) > 1:
                subprocess.run(
                    ["git", "-C", str(REPO), "worktree", "remove", "--force", str(Path(tmp) / "baseline")], check=False
                )
    print(f"\nmedian seconds from launch over {args.repeats} interleaved repeats (min/max off the median):")
    for name, runs in times.items():
        cells = []
        for phase in PHASES:
            values = [r[phase] for r in runs if phase in r]
            cells.append(f"{phase} {statistics.median(values):5.1f}s ({spread(values)})" if values else f"{phase} -")
        print(f"  {name:>20}: " + "  ".join(cells))
    if len(times) == 2:
        (cur, base) = (statistics.median(r["total"] for r in runs) for runs in times.values())
        print(f"  total: current / baseline = {cur / base:.2f} ({base - cur:+.1f} s per launch saved)")


if __name__ == "__main__":
    main()
