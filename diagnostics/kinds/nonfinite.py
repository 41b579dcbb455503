"""``nonfinite``: a loss or gradient was not finite. Its levers make the step more stable (clipping, warm-up,
a lower learning rate, a safer precision); whether they avoid the fault shows only in a rerun.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from diagnostics.analysis import Finding
from diagnostics.analysis.context import RunContext
from diagnostics.kinds.levers import Recommendation, lever, no_lever

# Not measured: the usual remedies for a loss or gradients that turn NaN/inf, to try in this order.
TRIED_NOT_MEASURED = {"fraction": 0.0, "basis": "not measured: whether it avoids the non-finite step shows in a rerun"}


MIN_WARMUP_STEPS = 100  # a warm-up shorter than this rarely protects Adam's first, noisy moment estimates


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    ev = finding.evidence
    stopped = ev.get("action") == "stopped"
    recs = _stability_levers(ctx, ev)
    if stopped and ev.get("policy") == "stop":
        why = (
            "drop the update of a rare bad step and go on (up to trainer.max_nan_skips of them) instead of stopping; "
            "it hides nothing: each skip is recorded and reported. Only for rare spikes: a diverging run skips until "
            "it stops anyway"
        )
        recs.append(lever("trainer.nan_policy", "skip", why, "the run rides over an isolated non-finite step"))
    last = ev.get("last_good_checkpoint")
    if stopped and last:
        path = Path(str(last))
        # The run dir resumes from its newest complete checkpoint, which is the last good one (none is written for
        # the bad step); a checkpoint outside a run's checkpoints/ is resumed from directly.
        target = path.parent.parent if path.parent.name == "checkpoints" else path
        why = (
            f"continues from the last good checkpoint ({path.name}) with any of the changes above that a resume takes "
            "(trainer.grad_clip, trainer.nan_policy, optimizer.warmup_steps); the base lr comes from the "
            "checkpoint's schedule, so a lower optimizer.lr needs a fresh run"
        )
        recs.append(lever("resume", str(target), why, "the steps before the bad one are kept"))
    elif stopped:
        recs.append(no_lever("no checkpoint was saved before the bad step: rerun with a change above", "-"))
    return [replace(r, ab_testable=False).gaining(TRIED_NOT_MEASURED) if r.key else r for r in recs]


def _stability_levers(ctx: RunContext, ev: dict[str, Any]) -> list[Recommendation]:
    """Lower lr, longer warm-up, clipping, a safer precision: each only where the run's config leaves room."""
    lr, warmup, clip = ctx.get("optimizer.lr"), ctx.get("optimizer.warmup_steps"), ctx.get("trainer.grad_clip")
    step = ev.get("stopped_at_step")
    if step is None and ev.get("skipped_steps"):
        step = ev["skipped_steps"][0]
    levers: list[Recommendation] = []
    if isinstance(lr, int | float) and not isinstance(lr, bool) and lr > 0:
        why = (
            "a learning rate too high for this model and batch is the most common cause of a loss that diverges to "
            f"NaN; half of {lr:g}"
        )
        levers.append(lever("optimizer.lr", float(f"{lr / 2:.3g}"), why, "smaller updates, slower early progress"))
    if isinstance(warmup, int) and not isinstance(warmup, bool):
        longer = max(2 * warmup, MIN_WARMUP_STEPS)
        at = (
            f" (the bad step, {step}, came {'during' if isinstance(step, int) and step < warmup else 'after'} it)"
            if isinstance(step, int)
            else ""
        )
        why = (
            f"a longer warm-up, {longer} steps instead of {warmup}{at}, keeps early updates small while Adam's moment "
            "estimates settle"
        )
        levers.append(lever("optimizer.warmup_steps", longer, why, "a gentler start; the peak lr is reached later"))
    if isinstance(clip, int | float) and not isinstance(clip, bool) and clip <= 0:
        why = "gradient clipping is off (trainer.grad_clip=0): one large gradient can push the weights to inf"
        levers.append(lever("trainer.grad_clip", 1.0, why, "every update's norm bounded by 1.0"))
    return levers + _safer_precision(ctx)


def _safer_precision(ctx: RunContext) -> list[Recommendation]:
    precision = ctx.get("precision.name")
    if precision == "fp16-mixed":
        why = "fp16 overflows above 65504; bf16 has fp32's exponent range (overflow only above ~3e38)"
        return [lever("precision", "bf16-mixed", why, "no fp16 overflow; same speed on GPUs with bf16")]
    if precision == "bf16-true":
        why = "bf16-true keeps the weights and optimizer states in bf16; bf16-mixed keeps fp32 master weights"
        return [lever("precision", "bf16-mixed", why, "fp32 weight updates; more memory for the fp32 copies")]
    if precision == "bf16-mixed":
        why = "rules reduced precision out as the cause: fp32 throughout"
        return [lever("precision", "fp32", why, "slower steps and more activation memory; a diagnosis, not a fix")]
    return []
