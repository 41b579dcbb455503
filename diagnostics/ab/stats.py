"""The statistics of an A/B test: per-arm medians and spread, the change with its confidence interval, a verdict.

Arms run interleaved (A B1 B2, A B1 B2, ...), so round ``r`` of every arm saw the same machine state: the change
is estimated from the paired log ratios ``ln(B_r / A_r)``, which cancels drift that hits a whole round. Its
interval is a Student t-interval of their mean, turned back into a relative change: ``exp(mean) - 1``.
Pure functions over lists of tokens/s (``None`` marks a run that failed), so they are tested on synthetic arms.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from diagnostics.analysis.stats import t_quantile

CONFIDENCE = 0.95
# The smallest change the test is meant to resolve: a change this large either way is worth knowing about.
RESOLUTION = 0.03
METHOD = f"{CONFIDENCE:.0%} t-interval of the mean paired log ratio ln(B/A) over interleaved rounds, as exp(.) - 1"
VERDICTS = ("confirmed", "no measurable effect", "worse", "failed", "inconclusive")


@dataclass(frozen=True)
class ArmStats:
    """Tokens/s of one arm over its repeats: ``failed`` runs gave no number."""

    runs: int
    failed: int
    median: float | None
    low: float | None
    high: float | None

    @property
    def spread(self) -> float | None:
        """(max - min) / median of the completed runs: the arm's run-to-run noise."""
        if self.median is None or self.low is None or self.high is None or not self.median:
            return None
        return (self.high - self.low) / self.median


def arm_stats(values: list[float | None]) -> ArmStats:
    done = [v for v in values if v is not None]
    if not done:
        return ArmStats(len(values), len(values), None, None, None)
    return ArmStats(len(values), len(values) - len(done), statistics.median(done), min(done), max(done))


@dataclass(frozen=True)
class Change:
    """B relative to A: ``estimate`` 0.05 is 5% more tokens/s; ``low``..``high`` its confidence interval."""

    estimate: float
    low: float
    high: float
    pairs: int  # rounds in which both arms completed

    @property
    def resolved(self) -> bool:
        """Whether the interval settles the question: it excludes zero, or it excludes a change of RESOLUTION."""
        return self.low > 0 or self.high < 0 or (self.low > -RESOLUTION and self.high < RESOLUTION)


def paired_change(original: list[float | None], recommended: list[float | None]) -> Change | None:
    """The change from round-paired runs (lists aligned by round), or None with fewer than 2 complete pairs."""
    if len(original) != len(recommended):
        raise ValueError(f"arms must be aligned by round: {len(original)} original vs {len(recommended)} recommended")
    logs = [math.log(b / a) for a, b in zip(original, recommended, strict=True) if a and b and a > 0 and b > 0]
    if len(logs) < 2:
        return None
    mean = statistics.fmean(logs)
    half = t_quantile(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return Change(math.expm1(mean), math.expm1(mean - half), math.expm1(mean + half), len(logs))


@dataclass(frozen=True)
class Verdict:
    verdict: str  # one of VERDICTS
    reason: str
    change: Change | None
    original: ArmStats
    recommended: ArmStats


def _signed(x: float) -> str:
    return f"{x:+.1%}"


def judge(original: list[float | None], recommended: list[float | None], rate: str = "tokens/s") -> Verdict:
    """The verdict of one recommendation from its arm and the original's, aligned by round.

    ``failed`` when any run of the recommended arm failed (the change breaks runs, whatever its speed);
    ``inconclusive`` with fewer than two rounds where both arms completed; otherwise ``confirmed`` / ``worse``
    when the interval lies above / below zero, else ``no measurable effect``.
    """
    a, b = arm_stats(original), arm_stats(recommended)
    change = paired_change(original, recommended)
    lost = f"; the original arm failed in {a.failed} of {a.runs} rounds" if a.failed else ""
    if b.failed:
        reason = f"{b.failed} of {b.runs} runs of the recommended arm failed (see their logs){lost}"
        return Verdict("failed", reason, change, a, b)
    if change is None:
        return Verdict("inconclusive", f"fewer than 2 rounds in which both arms completed{lost}", None, a, b)
    interval = f"{CONFIDENCE:.0%} CI {_signed(change.low)} .. {_signed(change.high)} over {change.pairs} rounds"
    if change.low > 0:
        return Verdict("confirmed", f"{_signed(change.estimate)} {rate}, {interval}{lost}", change, a, b)
    if change.high < 0:
        return Verdict("worse", f"{_signed(change.estimate)} {rate}, {interval}{lost}", change, a, b)
    if change.resolved:
        reason = f"{_signed(change.estimate)}, {interval}: any effect is smaller than {RESOLUTION:.0%}{lost}"
    else:
        reason = (
            f"{_signed(change.estimate)}, {interval}: too noisy to resolve a {RESOLUTION:.0%} change; more "
            f"repeats (--max-repeats) would narrow it{lost}"
        )
    return Verdict("no measurable effect", reason, change, a, b)


def needs_more(original: list[float | None], recommended: list[float | None]) -> bool:
    """Whether another round could change the verdict: no failure of the recommended arm, interval unresolved."""
    if any(v is None for v in recommended):
        return False  # already failed: more runs of a change that breaks runs tell nothing new
    change = paired_change(original, recommended)
    return change is None or not change.resolved
