"""Small statistics over telemetry values (pure Python: the analysis must run without numpy or torch)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TypeVar

from diagnostics.analysis.thresholds import MIN_STEPS_AFTER_WARMUP, WARMUP_STEPS

T = TypeVar("T")


def present(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def mean(values: Iterable[float | None]) -> float | None:
    vals = present(values)
    return sum(vals) / len(vals) if vals else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (the numpy default), ``q`` in [0, 100]."""
    vals = sorted(values)
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def median(values: Iterable[float | None]) -> float | None:
    return percentile(present(values), 50.0)


def interquartile_mean(values: Iterable[float | None]) -> float | None:
    """The mean of the middle half of the values: the centre of noise that comes in two clusters (a shared host
    holding one rank or the other, where a median picks a cluster) that a minority of outliers does not move."""
    ordered = sorted(present(values))
    if not ordered:
        return None
    quarter = len(ordered) // 4
    return mean(ordered[quarter : len(ordered) - quarter])


def ratio(part: float | None, whole: float | None) -> float | None:
    if part is None or whole is None or whole <= 0:
        return None
    return part / whole


def steady(steps: list[T]) -> list[T]:
    """The steps (records or one figure of each) after warm-up, if enough remain; all of them otherwise."""
    if len(steps) >= WARMUP_STEPS + MIN_STEPS_AFTER_WARMUP:
        return steps[WARMUP_STEPS:]
    return steps


def rounded(value: float | None, digits: int = 4) -> float | None:
    """Evidence numbers with 4 significant digits: enough to prove a point, short enough to read."""
    if value is None or value == 0:
        return value
    return float(f"{value:.{digits}g}")


# Two-sided 95% quantiles of Student's t by degrees of freedom (beyond 30: a first-order expansion around z).
_T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
    2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip
_Z_975 = 1.959964


def t_quantile(df: int) -> float:
    """The two-sided 95% critical value of Student's t with ``df`` degrees of freedom (df >= 1)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    if df <= len(_T_975):
        return _T_975[df - 1]
    return _Z_975 + (_Z_975**3 + _Z_975) / (4 * df)


def mean_lower_bound(values: Sequence[float]) -> float | None:
    """The lower end of the two-sided 95% t-interval of the mean of ``values`` (None with fewer than two).

    A cost graded on it is at least that large with confidence: a finding whose true cost sits just under a
    severity threshold does not cross it whenever a noisy run reads it a point high.
    """
    if len(values) < 2:
        return None
    mu = sum(values) / len(values)
    sd = math.sqrt(sum((v - mu) ** 2 for v in values) / (len(values) - 1))
    return mu - t_quantile(len(values) - 1) * sd / math.sqrt(len(values))
