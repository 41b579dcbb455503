"""Run an A/B test: the original arm and each recommended arm, interleaved round by round, one run at a time.

Every run gets its own directory, ``RUN/ab/setN/<round>-<arm>`` (with ``<round>-<arm>.log`` beside it), and
each ``--ab --run`` adds a new set, so neither the original run nor an earlier A/B is ever overwritten. After
``repeats`` rounds, a recommendation keeps getting rounds while its interval neither excludes zero nor
excludes a RESOLUTION change, up to ``max_repeats`` rounds.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from diagnostics.ab.stats import needs_more
from diagnostics.analysis import load_run
from diagnostics.analysis.summary import summarize
from diagnostics.recommend import AbTest

AB_DIR = "ab"
ORIGINAL = "A"
SET_NAME = re.compile(r"^set(\d+)$")


@dataclass(frozen=True)
class Arm:
    name: str  # A, B1, B2, ...
    label: str  # "original" or the recommendation's override
    overrides: tuple[str, ...]  # after ``python -m train``
    expected_gain: float | None = None  # share of the step the recommendation expects to save (None: original)
    metric: str = "tokens_per_s"  # what its test compares (RunOutcome.rate): the steps' rate or the loop's

    def argv(self, run_dir: Path) -> list[str]:
        return [*self.overrides, f"hydra.run.dir={run_dir}"]

    def shell(self, run_dir: Path) -> str:
        return "python -m train " + shlex.join(self.argv(run_dir))


def plan_arms(tests: list[AbTest]) -> list[Arm]:
    """The original arm (shared by every test) and one arm per recommendation, in the tests' order."""
    if not tests:
        return []
    arms = [Arm(ORIGINAL, "original", tests[0].original)]
    return arms + [Arm(f"B{i}", t.override, t.recommended, t.expected_gain, t.metric) for i, t in enumerate(tests, 1)]


@dataclass(frozen=True)
class RunOutcome:
    run_dir: Path
    tokens_per_s: float | None  # None: the run failed
    error: str | None = None
    seconds: float = 0.0
    # Tokens over the training loop's wall-clock time, validation and checkpoint writes included (analysis.pauses).
    loop_tokens_per_s: float | None = None
    # The rates' unit: a run's work unit (a LightningModule's runs count samples; tokens_per_s then holds samples/s).
    rate_label: str = "tokens/s"

    def rate(self, metric: str) -> float | None:
        """``tokens_per_s`` (training steps only) or ``loop_tokens_per_s``; None for a failed run."""
        if self.tokens_per_s is None:
            return None
        return self.loop_tokens_per_s if metric == "loop_tokens_per_s" else self.tokens_per_s


@dataclass
class ArmRuns:
    """The outcomes of one arm, keyed by round (an arm that stopped early has fewer rounds than the original)."""

    arm: Arm
    rounds: dict[int, RunOutcome] = field(default_factory=dict)


@dataclass
class AbSet:
    set_dir: Path
    arms: list[ArmRuns]
    rounds: int = 0

    def aligned(self, arm: ArmRuns) -> tuple[list[float | None], list[float | None]]:
        """(original, arm) rates over the rounds ``arm`` ran, in the arm's metric: the paired samples of its test."""
        original, metric = self.arms[0], arm.arm.metric
        rounds = sorted(arm.rounds)
        return [original.rounds[r].rate(metric) for r in rounds], [arm.rounds[r].rate(metric) for r in rounds]


def next_set_dir(run_dir: Path) -> Path:
    """``RUN/ab/setN`` with N one more than any set there: a new A/B never reuses an earlier one's directories."""
    ab = Path(run_dir) / AB_DIR
    taken = [int(m.group(1)) for p in ab.glob("set*") if (m := SET_NAME.match(p.name))] if ab.is_dir() else []
    return ab / f"set{max(taken, default=0) + 1}"


def claim_set_dir(run_dir: Path) -> Path:
    """Create ``RUN/ab/setN`` for this A/B alone: two ``--ab --run`` started at once both see N free, and the
    directory's own exclusive create (``mkdir`` without ``exist_ok``) decides; the loser takes the next number."""
    while True:
        set_dir = next_set_dir(run_dir)
        set_dir.parent.mkdir(parents=True, exist_ok=True)
        try:
            set_dir.mkdir()
            return set_dir
        except FileExistsError:
            continue  # taken between the listing and the create: a later listing sees it


def tokens_per_s(run_dir: Path) -> float | None:
    """The run's tokens/s as its report states it (the analysis reader), or None without telemetry."""
    return rates(run_dir)[0]


def rates(run_dir: Path) -> tuple[float | None, float | None, str]:
    """(training steps' rate, the loop's wall-clock rate, their unit: tokens/s or samples/s) as the report states
    them; Nones without telemetry."""
    try:
        summary, _ = summarize(load_run(run_dir))
    except FileNotFoundError:
        return None, None, "tokens/s"
    return summary.tokens_per_s, (summary.loop or {}).get("loop_tokens_per_s"), summary.rate_label


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def launch_train(arm: Arm, run_dir: Path) -> RunOutcome:
    """``python -m train`` for one run of ``arm`` into ``run_dir``; its output goes to ``run_dir``.log."""
    return run_train(arm.argv(run_dir), run_dir)


def run_train(argv: list[str], run_dir: Path) -> RunOutcome:
    """``python -m train ARGV``, a command that runs into ``run_dir`` (here, or as a job it waits for), its output
    to ``run_dir``.log; the outcome is read from ``run_dir``'s telemetry."""
    log = run_dir.with_name(run_dir.name + ".log")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    start = time.monotonic()
    with log.open("w", encoding="utf-8") as out:
        code = subprocess.run(
            [sys.executable, "-m", "train", *argv], stdout=out, stderr=subprocess.STDOUT, env=env
        ).returncode
    seconds = time.monotonic() - start
    if code != 0:
        return RunOutcome(run_dir, None, f"exit code {code}: {_last_line(log)} (log: {log})", seconds)
    value, loop, label = rates(run_dir)
    if value is None:
        return RunOutcome(run_dir, None, f"no throughput recorded in {run_dir}/telemetry (log: {log})", seconds)
    return RunOutcome(run_dir, value, None, seconds, loop, label)


Launcher = Callable[[Arm, Path], RunOutcome]


def _say_outcome(say: Callable[[str], None], round_no: int, arm: Arm, outcome: RunOutcome, loop: bool) -> None:
    rate = outcome.tokens_per_s
    what = f"{rate:,.0f} {outcome.rate_label}" if rate is not None else f"failed, {outcome.error}"
    if loop and outcome.loop_tokens_per_s is not None:
        what += f" ({outcome.loop_tokens_per_s:,.0f} with validation and checkpoints)"
    say(f"ab: round {round_no} {arm.name} ({arm.label}): {what} [{outcome.seconds:.0f} s]")


def run_ab(
    run_dir: Path,
    tests: list[AbTest],
    repeats: int,
    max_repeats: int,
    launch: Launcher = launch_train,
    say: Callable[[str], None] = print,
    set_dir: Path | None = None,
) -> AbSet:
    """Interleave rounds of every arm until each test is settled (at least ``repeats``, at most ``max_repeats``).
    ``set_dir``: the set this A/B claimed already (``claim_set_dir``), else it claims the next one."""
    arms = [ArmRuns(arm) for arm in plan_arms(tests)]
    ab = AbSet(set_dir or claim_set_dir(run_dir), arms)
    active = arms[1:]
    loop = any(runs.arm.metric == "loop_tokens_per_s" for runs in active)
    for round_no in range(1, max_repeats + 1):
        for runs in [arms[0], *active]:  # the original first: every round has its own baseline
            outcome = launch(runs.arm, ab.set_dir.resolve() / f"{round_no:02d}-{runs.arm.name}")
            runs.rounds[round_no] = outcome
            _say_outcome(say, round_no, runs.arm, outcome, loop)
        ab.rounds = round_no
        if round_no >= repeats:
            active = [runs for runs in active if needs_more(*ab.aligned(runs))]
            if not active:
                break
    return ab
