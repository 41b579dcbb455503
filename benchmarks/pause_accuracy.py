"""Does ``pauses`` cost validation and checkpoint writes at what they take from the run, and does its top lever
gain what it expects?

Cases drawn from a seed (strategy, validation interval and batches, checkpoint interval, model), each run in three
arms interleaved per repeat so drift on a shared machine hits all of them:

- paused: the drawn intervals;
- without (the counterfactual of the cost): validation and checkpoints only at the last step;
- fixed (the counterfactual of the lever): the paused run with its report's first ``pauses`` override.

Throughput is the training loop's wall-clock rate (``summary.loop["loop_tokens_per_s"]``: tokens over rank 0's
first to last recorded step, pauses included), the same definition in every arm. measured cost = 1 -
rate(paused) / rate(without); measured gain = 1 - rate(paused) / rate(fixed) (the share of the paused run's time
the lever saved, the scale of its expected gain). Target: cost and gain within 7 points. A measurement: prints
and exits 0 whatever the outcome; quote ``uptime``'s load average with its figures.

    python benchmarks/pause_accuracy.py [--seed 0] [--cases 3] [--repeats 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))
from diagnosis_accuracy import PLUGIN_DATA, PLUGIN_MODEL, SHORT, run_train  # noqa: E402

from diagnostics.diagnosis import analyse  # noqa: E402
from diagnostics.recommend import recommend_all  # noqa: E402

TOLERANCE = 0.07
STEPS = 40
BASE = [arg for arg in SHORT if not arg.startswith(("trainer.val_", "trainer.ckpt_", "trainer.max_steps"))]
BASE += [f"trainer.max_steps={STEPS}"]
# The built-in default and a user's own model and datamodule (by _target_). Loops of a few seconds (a 2-layer
# 64-wide gpt-nano: ~2 s for 40 steps) move 20% between identical runs, more than the pauses' effect: not drawn.
MODELS = {"gpt-nano": [], "user-model": [*PLUGIN_MODEL, *PLUGIN_DATA]}


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[str, ...]  # the paused arm's

    @property
    def without(self) -> tuple[str, ...]:
        kept = [o for o in self.overrides if not o.startswith(("trainer.val_every", "trainer.ckpt_every"))]
        return (*kept, f"trainer.val_every_n_steps={STEPS}", f"trainer.ckpt_every_n_steps={STEPS}")


def draw(seed: int, cases: int) -> list[Case]:
    rng = random.Random(f"pauses-{seed}")
    out = []
    for i in range(cases):
        strategy, model = rng.choice(["ddp", "fsdp"]), rng.choice(sorted(MODELS))
        val_every, val_batches, ckpt_every = rng.randint(4, 12), rng.choice([2, 4, 8, 16, 32]), rng.randint(3, 15)
        name = f"{i}-{strategy}-{model}-val{val_every}x{val_batches}-ckpt{ckpt_every}"
        overrides = (f"strategy={strategy}", *MODELS[model], f"trainer.val_every_n_steps={val_every}",
                     f"trainer.val_batches={val_batches}", f"trainer.ckpt_every_n_steps={ckpt_every}")  # fmt: skip
        out.append(Case(name, overrides))
    return out


def loop_rate(run_dir: Path) -> tuple[float | None, float, str | None, float]:
    """(the loop's tokens/s, the reported pauses cost, its first override, that override's expected gain)."""
    analysis = analyse(run_dir)
    rate = (analysis.summary.loop or {}).get("loop_tokens_per_s")
    recs = recommend_all(analysis)
    for finding, found in zip(analysis.findings, recs, strict=True):
        if finding.kind == "pauses" and (first := next((r for r in found if r.override), None)) is not None:
            return rate, finding.cost_fraction, first.override, float(first.expected_gain["fraction"])
        if finding.kind == "pauses":
            return rate, finding.cost_fraction, None, 0.0
    return rate, 0.0, None, 0.0


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measure(case: Case, repeats: int, root: Path) -> str:
    rates: dict[str, list[float]] = {"paused": [], "without": [], "fixed": []}
    reported: list[float] = []
    fix: str | None = None
    expected = 0.0
    for r in range(repeats):
        for arm in ("paused", "without", "fixed"):
            if arm == "fixed" and fix is None:
                continue
            overrides = {"paused": case.overrides, "without": case.without, "fixed": (*case.overrides, fix or "")}
            run_dir = root / case.name / f"{r}-{arm}"
            run_dir.parent.mkdir(parents=True, exist_ok=True)
            result = run_train(list(overrides[arm]), run_dir, base=BASE)
            if not result.ok:
                print(f"  {case.name} {arm}: failed {result.error}")
                continue
            rate, cost, override, gain = loop_rate(run_dir)
            if rate:
                rates[arm].append(rate)
            if arm == "paused":
                reported.append(cost)
                if fix is None:
                    fix, expected = override, gain
    paused, without, fixed = (median(rates[a]) for a in ("paused", "without", "fixed"))
    cost = 1 - paused / without if paused and without else None
    gain = 1 - paused / fixed if paused and fixed else None
    spread = {a: (min(v), max(v)) for a, v in rates.items() if v}
    told = median(reported)
    ok = told is not None and cost is not None and abs(told - cost) <= TOLERANCE
    line = (
        f"{case.name}: reported {told:.1%} measured {cost:.1%} ({'within' if ok else 'OUTSIDE'} 7 points)"
        if told is not None and cost is not None
        else f"{case.name}: no measurement"
    )
    if gain is not None:
        line += f"; fix {fix}: gain expected {expected:.1%} measured {gain:.1%}"
    return line + f"; loop tokens/s min..max {spread}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keep", type=Path, default=None)
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="pauses-"))
    for case in draw(args.seed, args.cases):
        print(measure(case, args.repeats, root), flush=True)
    print(f"runs in {root}")


if __name__ == "__main__":
    main()
