"""The slow-step tail: how much of the run's time its slow steps take, and whether a finding explains it.

The typical (median) step is what most detectors cost against; a run whose mean step sits far above its median
loses that difference on every token it trains. A finding that names the tail (an intermittent stall's pattern,
a straggler or a data wait costed on the run's time) explains it; what is left is reported as unexplained, so a
report never shows a slow tail without saying whether it knows why.
"""

from __future__ import annotations

from typing import Any

from diagnostics.analysis.finding import Finding
from diagnostics.analysis.stats import rounded

# Kinds whose cost can come from steps slower than the median (their cost then counts against the tail).
TAIL_KINDS = ("straggler", "input_bound", "hang", "nonfinite")
# A tail under this share of the run's time is noise, not something to explain.
TAIL_FRACTION = 0.1


def slow_tail(step_time: dict[str, float | None], findings: list[Finding]) -> dict[str, Any] | None:
    """``{"share", "explained_by", "unexplained_share"}``: the run's time beyond its median step (mean - p50) / mean,
    the findings that account for it, and what no finding does; None without step times."""
    p50, mean = step_time.get("p50"), step_time.get("mean")
    if not p50 or not mean:
        return None
    share = max(0.0, 1.0 - p50 / mean)
    explaining = [f for f in findings if f.kind in TAIL_KINDS and "pattern" in f.evidence]
    explained = min(share, sum(f.cost_fraction for f in explaining))
    return {
        "share": rounded(share),
        "explained_by": [f.kind for f in explaining],
        "unexplained_share": rounded(max(0.0, share - explained)),
        "threshold": TAIL_FRACTION,
    }


def tail_line(tail: dict[str, Any] | None) -> str | None:
    """One console/report line for a tail worth a word, else None."""
    if not tail or (tail["share"] or 0.0) < TAIL_FRACTION:
        return None
    share, left = tail["share"] or 0.0, tail["unexplained_share"] or 0.0
    lead = f"slow-step tail: {share:.0%} of the run's time is beyond the median step"
    if tail["explained_by"] and left < TAIL_FRACTION / 2:
        return f"{lead}, explained by {', '.join(tail['explained_by'])}"
    return f"{lead}; {left:.0%} of it no finding explains (the per-rank step records are in telemetry/)"
