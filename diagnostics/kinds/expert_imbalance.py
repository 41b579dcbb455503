"""``expert_imbalance``: a mixture-of-experts run routes more tokens to some experts (and their ranks) than to
others. Its levers are the expert placement computed from the measured loads, the capacity factor and the
load-balancing loss.
"""

from __future__ import annotations

from diagnostics.analysis import Finding
from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import pct
from diagnostics.analysis.thresholds import (
    PLACEMENT_MIN_CUT,
)
from diagnostics.kinds.levers import HALF, Recommendation, gain, lever

# Where a capacity limit is suggested: Switch Transformer's and GShard's usual training value.
CAPACITY_FACTOR = 1.25


AUX_LOSS_DEFAULT = 0.01  # the load-balancing weight Switch, Mixtral (0.02) and OLMoE train with, order of magnitude


AUX_LOSS_MAX = 0.1  # beyond it the balancing term competes with the LM loss (Switch: quality drops past ~0.1)


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    ev = finding.evidence
    recs: list[Recommendation] = []
    coef = float(ev.get("aux_loss_coef") or 0.0)
    stronger = AUX_LOSS_DEFAULT if coef <= 0 else min(AUX_LOSS_MAX, 10 * coef)
    balance_key = ev.get("aux_loss_key", "model.aux_loss_coef")
    if balance_key and stronger > coef:
        why = (
            f"the load-balancing loss ({balance_key}={coef:g}) leaves expert {ev.get('hottest_expert')} with "
            f"{pct(float(ev.get('hottest_expert_share') or 0))} of layer {ev.get('layer')}'s assignments"
        )
        effect = "the router spreads tokens more evenly over training; a larger share of the loss is balancing"
        recs.append(
            lever(balance_key, stronger, why, effect).gaining(
                gain(finding, HALF, "assumed: a stronger balancing loss removes about half of the excess over a run")
            )
        )
    capacity = ev.get("capacity_factor")
    capacity_key = ev.get("capacity_key", "model.capacity_factor")
    excess = float(ev.get("load_excess") or 0.0)
    recs += _placement_lever(finding, ctx, excess)
    if capacity_key and (capacity is None or float(capacity) > CAPACITY_FACTOR) and excess > CAPACITY_FACTOR - 1.0:
        # Each expert computes at most capacity_factor x its even share, so the busiest rank's excess over the mean
        # shrinks to about capacity_factor - 1 of it.
        share = 1.0 - (CAPACITY_FACTOR - 1.0) / excess
        why = (
            f"the busiest rank computes {pct(excess)} more expert work than the mean of its group; a capacity of "
            f"{CAPACITY_FACTOR}x the even share caps it"
        )
        effect = "assignments beyond capacity are dropped (those tokens skip the expert): check the loss"
        recs.append(
            lever(capacity_key, CAPACITY_FACTOR, why, effect).gaining(
                gain(finding, share, f"the excess capped at {CAPACITY_FACTOR - 1:.2f} of the mean load")
            )
        )
    # A placement first where it expects the most: it leaves the model's function alone (the other two change the
    # training) and its gain is read from the measured loads.
    placed = [r for r in recs if r.key == "strategy.expert_placement"]
    if placed and _gain_of(placed[0]) >= max(_gain_of(r) for r in recs):
        return placed + [r for r in recs if r not in placed]
    return recs


def _gain_of(rec: Recommendation) -> float:
    return float(rec.expected_gain.get("fraction") or 0.0)


def _placement_lever(finding: Finding, ctx: RunContext, excess: float) -> list[Recommendation]:
    """The experts re-placed on the group's ranks so that the measured loads even out (strategy=fsdp's
    ``strategy.expert_placement``; the tp ranks of strategy=megatron split experts in order)."""
    ev = finding.evidence
    placement, after = ev.get("balanced_placement"), float(ev.get("load_excess_balanced") or 0.0)
    if not placement or not excess or ctx.get("strategy.name") != "fsdp" or after > excess * (1 - PLACEMENT_MIN_CUT):
        return []
    why = (
        f"the group's busiest rank computes {pct(excess)} more expert work than the mean; holding the experts as "
        f"placed here, the same measured loads leave it {pct(after)} above"
    )
    effect = "the same model and tokens; only which rank computes which expert changes (checkpoints are unaffected)"
    basis = "the measured per-expert loads re-placed: the busiest rank's excess over the mean, before and after"
    return [
        lever("strategy.expert_placement", placement, why, effect).gaining(gain(finding, 1.0 - after / excess, basis))
    ]
