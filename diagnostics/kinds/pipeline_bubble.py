"""``pipeline_bubble``: pipeline stages idle while the pipeline fills and drains. Its levers are more micro-batches
per step (the bubble shrinks as (pp - 1) / m) and interleaved stages.
"""

from __future__ import annotations

from typing import Any

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding, costed, ranks_verb
from diagnostics.analysis.finding import pct as _pct
from diagnostics.analysis.load import RunTelemetry
from diagnostics.analysis.stats import mean, rounded, steady
from diagnostics.analysis.summary import RankPhases, Summary
from diagnostics.analysis.thresholds import COST_WARNING
from diagnostics.kinds.levers import HALF, Recommendation, bigger_global, gain, kept_global, lever

# pipeline_bubble: the idle share of a pipeline schedule, (pp-1)/(m+pp-1) for GPipe/1F1B. 15% is about what
# the common m = 4·pp microbatches cost (3/19 = 16% at pp=4); beyond it more microbatches pay.
BUBBLE_FRACTION = 0.15
# The thresholds above, by name, for the report (report.json's ``thresholds``).
THRESHOLDS = {"BUBBLE_FRACTION": BUBBLE_FRACTION}


def detect(run: RunTelemetry, summary: Summary, phases: list[RankPhases]) -> list[Finding]:
    """Idle time inside the pipeline schedule. Its cost is the idle share every stage pays (the least idle stage's):
    a stage that idles more than that waits for a slower peer, and that wait is the peer's cost (kinds/straggler
    blames a stage slow outside its schedule; a stage slower inside it is an imbalance of the stages' work)."""
    bubbles = {
        rank: b for rank, tele in run.ranks.items() if (b := mean(s.bubble_fraction for s in steady(tele.steps)))
    }
    flagged = sorted(r for r, b in bubbles.items() if b >= BUBBLE_FRACTION)
    if not flagged:
        return []
    every_stage = min(bubbles.values())
    worst = max(bubbles[r] for r in flagged)
    evidence = {
        "bubble_fraction": {r: rounded(bubbles[r]) for r in flagged},
        "every_stage_fraction": rounded(every_stage),
        "threshold_fraction": BUBBLE_FRACTION,
    }
    message = f"{ranks_verb(flagged, 'idles', 'idle')} {_pct(worst)} of each step in the pipeline schedule"
    if worst - every_stage >= COST_WARNING:
        least = min(bubbles, key=lambda r: bubbles[r])
        message += (
            f"; {_pct(every_stage)} is the bubble every stage pays, the rest is waiting for rank {least} "
            "(slower than the other stages)"
        )
    else:
        message += "'s bubble"
    basis = "mean idle time inside the schedule / step time, least idle stage (the bubble all pay), steady steps"
    return [costed("pipeline_bubble", flagged, evidence, message, every_stage, basis, metric=every_stage)]


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    recs: list[Recommendation] = []
    pp, m, micro = ctx.get("strategy.pp"), ctx.get("strategy.microbatches"), ctx.micro()
    if ctx.strategy == "megatron" and isinstance(pp, int) and pp > 1:
        m = m if isinstance(m, int) else pp
        if micro and micro % 2 == 0:
            why = (
                f"the same global batch in twice the micro-batches (m={2 * m}) halves the bubble, (pp-1)/(m+pp-1) of "
                "the step, with the same optimizer batch"
            )
            pinned = (f"trainer.micro_batch_size={micro // 2}", *kept_global(ctx))
            rec = lever("strategy.microbatches", 2 * m, why, "about half the idle share per step", pinned)
            recs.append(rec.gaining(_bubble_gain(finding, pp, 2 * m)))
        layers = ctx.get("model.n_layers")
        interleavable = isinstance(layers, int) and layers % (2 * pp) == 0 and m % pp == 0
        if ctx.get("strategy.schedule") in ("gpipe", "1f1b") and interleavable:
            why = "two model chunks per pipeline rank (interleaved 1F1B) divide the bubble by two at the same batch"
            effect = "half the bubble, for twice the stage-to-stage messages"
            rec = lever("strategy.schedule", "interleaved_1f1b", why, effect, ("strategy.virtual_stages=2",))
            recs.append(rec.gaining(gain(finding, HALF, "two chunks per rank halve the bubble")))
    why = "more microbatches per step shrink the schedule's bubble, (pp-1)/(m+pp-1) of the step"
    bigger = bigger_global(ctx, why, "smaller idle share per step")
    if isinstance(pp, int) and pp > 1 and isinstance(m, int):
        bigger = [r.gaining(_bubble_gain(finding, pp, 2 * m)) for r in bigger]
    return recs + bigger


def _bubble_gain(finding: Finding, pp: int, m: int) -> dict[str, Any]:
    """The measured bubble scaled by how the schedule's bubble, (pp-1)/(m+pp-1), shrinks from m/2 to ``m``
    micro-batches. A ratio, not the formula's value: interleaved and zero-bubble schedules measure far below the
    1F1B formula (zero-bubble pp=2, m=2: 12-15% against its 33%), and a stage that idles for other reasons (uneven
    stages) keeps that part."""
    before, after = (pp - 1) / (m // 2 + pp - 1), (pp - 1) / (m + pp - 1)
    saved = finding.cost_fraction * (1.0 - after / before)
    return {
        "fraction": round(saved, 4),
        "basis": f"measured bubble x (1 - b(m={m}) / b(m={m // 2})), b = (pp-1)/(m+pp-1)",
    }
