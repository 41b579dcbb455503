"""Small statistics over telemetry values (pure Python: the analysis must run without numpy or torch)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from diagnostics.analysis.load import StepRecord
from diagnostics.analysis.thresholds import MIN_STEPS_AFTER_WARMUP, WARMUP_STEPS


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


def ratio(part: float | None, whole: float | None) -> float | None:
    if part is None or whole is None or whole <= 0:
        return None
    return part / whole


def steady(steps: list[StepRecord]) -> list[StepRecord]:
    """The steps after warm-up, if enough remain; all of them otherwise."""
    if len(steps) >= WARMUP_STEPS + MIN_STEPS_AFTER_WARMUP:
        return steps[WARMUP_STEPS:]
    return steps


def rounded(value: float | None, digits: int = 4) -> float | None:
    """Evidence numbers with 4 significant digits: enough to prove a point, short enough to read."""
    if value is None or value == 0:
        return value
    return float(f"{value:.{digits}g}")
