"""``pipeline_bubble``: pipeline stages idle while the pipeline fills and drains. Its levers are more micro-batches
per step (the bubble shrinks as (pp - 1) / m) and interleaved stages.
"""

from __future__ import annotations

from typing import Any

from diagnostics.analysis import Finding
from diagnostics.analysis.context import RunContext
from diagnostics.kinds.levers import HALF, Recommendation, bigger_global, gain, kept_global, lever


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
