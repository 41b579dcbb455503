"""``throttling``: a device runs below its clocks (power or temperature). No config lever: the recommendation
names the device and what to check.
"""

from __future__ import annotations

from diagnostics.analysis import Finding
from diagnostics.analysis.context import RunContext
from diagnostics.kinds.levers import ALL_OF_IT, Recommendation, gain, no_lever


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    why = (
        f"{finding.message}; check cooling and power limits (nvidia-smi -q -d PERFORMANCE,POWER,TEMPERATURE) and "
        "move the job off that node if it persists"
    )
    return [no_lever(why, "full clocks again on that device").gaining(gain(finding, ALL_OF_IT, "the clock lost"))]
