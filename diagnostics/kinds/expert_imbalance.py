"""``expert_imbalance``: a mixture-of-experts run routes more tokens to some experts (and their ranks) than to
others. Its levers are the expert placement computed from the measured loads, the capacity factor and the
load-balancing loss.
"""

from __future__ import annotations

from typing import Any

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.expert_placement import as_placement, balanced_placement
from diagnostics.analysis.expert_placement import excess as excess_of
from diagnostics.analysis.finding import Finding, costed, pct
from diagnostics.analysis.load import RunTelemetry
from diagnostics.analysis.stats import mean
from diagnostics.analysis.summary import RankPhases, Summary
from diagnostics.analysis.thresholds import MIN_STEPS_AFTER_WARMUP, PLACEMENT_MIN_CUT, WARMUP_STEPS
from diagnostics.kinds.levers import HALF, Recommendation, gain, lever

# expert_imbalance: the most loaded expert-parallel rank computes this much more than the mean rank of its group
# (over the run's steady steps, summed over layers). Top-k routing of a freshly initialised router spreads tokens
# within a few percent of even (moe-micro on 2 ranks: 1-4%); 10% is outside that band.
EXPERT_IMBALANCE_MIN = 0.10
# The thresholds above, by name, for the report (report.json's ``thresholds``).
THRESHOLDS = {"EXPERT_IMBALANCE_MIN": EXPERT_IMBALANCE_MIN}


def _kept(rec: dict[str, Any]) -> list[list[int]]:
    return [
        [a - d for a, d in zip(routed, dropped, strict=True)]
        for routed, dropped in zip(rec["routed"], rec["dropped"], strict=True)
    ]


def _steady_steps(run: RunTelemetry, ranks: list[int]) -> list[int]:
    """Steps every rank of ``ranks`` recorded, after the warm-up when enough remain."""
    common = set.intersection(*({r["step"] for r in run.ranks[rank].experts} for rank in ranks))
    steps = sorted(common)
    return steps[WARMUP_STEPS:] if len(steps) >= WARMUP_STEPS + MIN_STEPS_AFTER_WARMUP else steps


def expert_loads(run: RunTelemetry, members: list[int], steps: list[int]) -> list[list[int]]:
    """``loads[layer][e]``: assignments expert ``e`` computed over ``steps`` from all members' tokens."""
    loads: list[list[int]] = []
    for rank in members:
        by_step = {r["step"]: _kept(r) for r in run.ranks[rank].experts}
        for step in steps:
            for layer, counts in enumerate(by_step[step]):
                if len(loads) <= layer:
                    loads.append([0] * len(counts))
                loads[layer] = [a + b for a, b in zip(loads[layer], counts, strict=True)]
    return loads


def held_experts(layout: dict[str, Any], layer: int, ep: int) -> list[list[int]]:
    """Per group rank, the experts it computes in ``layer``: its slots' (strategy.expert_placement, else slot =
    expert id)."""
    local = int(layout["num_experts"]) // ep
    placements = layout.get("placement") or []
    order = placements[layer] if layer < len(placements) and placements[layer] else range(local * ep)
    return [list(order[j * local : (j + 1) * local]) for j in range(ep)]


def rank_loads(per_expert: list[list[int]], layout: dict[str, Any], ep: int) -> list[list[int]]:
    """``loads[layer][j]``: assignments group rank ``j`` computed (its experts' loads summed)."""
    return [
        [sum(layer[e] for e in held) for held in held_experts(layout, index, ep)]
        for index, layer in enumerate(per_expert)
    ]


def waited_for_experts(calls: list[list[float]], after: list[int]) -> float:
    """Seconds one step lost to the ranks' uneven expert work, from one step's all-to-alls of a group's ranks.

    ``calls[j]``: rank ``j``'s all-to-alls in order; ``after``: the positions of those that end the experts'
    compute. A call lasts from a rank's arrival until the last one arrived: beyond the call's minimum over the
    ranks, a rank was waiting. At an exchange after the experts, the mean wait over the group is what the rank
    with the most expert work kept the others (and so the step) waiting; the exchanges before them, which the
    same work precedes on every rank, wait as much for other reasons (a shared host's turns): their mean wait
    per call is taken off each exchange after the experts."""
    mean_waits = [sum(column) / len(column) - min(column) for column in zip(*calls, strict=True)]
    before = [w for i, w in enumerate(mean_waits) if i not in set(after)]
    baseline = sum(before) / len(before) if before else 0.0
    return max(0.0, sum(mean_waits[i] - baseline for i in after if i < len(mean_waits)))


def _measured_wait(run: RunTelemetry, members: list[int], steps: list[int]) -> float | None:
    """Mean over ``steps`` of ``waited_for_experts``; None where a step's exchanges were not all recorded alike
    (older collectors, or a GPU, where NCCL's calls return before the data moves)."""
    chosen = set(steps)
    records = {rank: {s.step: s for s in run.ranks[rank].steps if s.step in chosen} for rank in members}
    lost = []
    for step in steps:
        found = [records[rank].get(step) for rank in members]
        rows = [r for r in found if r is not None]
        if len(rows) < len(found):
            continue  # a step some rank has no timing record of (its profiled or validation step)
        if any(not r.all_to_all_calls_s or r.all_to_all_after_experts is None for r in rows):
            return None
        calls = [r.all_to_all_calls_s for r in rows if r.all_to_all_calls_s]
        after = {tuple(r.all_to_all_after_experts or ()) for r in rows}
        if len({len(c) for c in calls}) != 1 or len(after) != 1 or not next(iter(after)):
            return None
        lost.append(waited_for_experts(calls, list(next(iter(after)))))
    return sum(lost) / len(lost) if lost else None


def _group_cost(run: RunTelemetry, members: list[int], layout: dict[str, Any]) -> dict[str, Any] | None:
    steps = _steady_steps(run, members)
    if not steps:
        return None
    per_expert = expert_loads(run, members, steps)
    loads = rank_loads(per_expert, layout, len(members))
    means = [sum(layer) / len(layer) for layer in loads]
    excess = [max(layer) - m for layer, m in zip(loads, means, strict=True)]
    if not sum(means):
        return None
    load_excess = sum(excess) / sum(means)
    records = [s for rank in members for s in run.ranks[rank].steps if s.step in set(steps)]
    compute = mean(s.local_compute_s for s in records)
    step_s = mean(s.step_s for s in records)
    flops = run.meta("flops_per_token")
    if not compute or not step_s or not flops:
        return None
    share = min(1.0, layout["routed_flops_per_token"] / flops)
    waited = _measured_wait(run, members, steps)
    # Measured where the exchanges were timed call by call; else from the FLOPs (expert GEMMs at the model's mean
    # rate): on small CPU experts, whose time is not proportional to their tokens, that read 13.8% of the step
    # where re-placing the experts measured +3.7% (the waits read 2.2%).
    lost = waited if waited is not None else compute * share * load_excess / (1.0 + share * load_excess)
    worst = max(range(len(loads)), key=lambda layer: excess[layer] / means[layer] if means[layer] else 0.0)
    hot = max(range(len(members)), key=lambda j: loads[worst][j])
    routed = [0] * layout["num_experts"]
    dropped = 0
    for rank in members:
        for rec in run.ranks[rank].experts:
            if rec["step"] in set(steps):
                routed = [a + b for a, b in zip(routed, rec["routed"][worst], strict=True)]
                dropped += sum(sum(layer) for layer in rec["dropped"])
    total = sum(sum(sum(layer) for layer in rec["routed"]) for rank in members for rec in run.ranks[rank].experts)
    current = [held_experts(layout, layer, len(members)) for layer in range(len(per_expert))]
    balanced = balanced_placement(per_expert, current)
    return {
        "members": members,
        # The even placement of the measured loads, and the busiest rank's excess it would leave (analysis/
        # expert_placement.py): strategy.expert_placement's lever.
        "balanced_placement": as_placement(balanced) if balanced != current else None,
        "load_excess_balanced": excess_of(per_expert, balanced),
        # The model's layer index (a pipeline stage's layers are not its first ones); older runs: the position.
        "layer": (layout.get("layer_ids") or list(range(len(loads))))[worst],
        "hot_rank": members[hot],
        "load_excess": load_excess,
        "layer_load_ratio": [round(max(layer) / m, 3) if m else None for layer, m in zip(loads, means, strict=True)],
        "hottest_expert": max(range(len(routed)), key=routed.__getitem__),
        "hottest_expert_share": max(routed) / sum(routed) if sum(routed) else 0.0,
        "dropped_fraction": dropped / total if total else 0.0,
        "expert_flops_share": share,
        "lost_s_per_step": lost,
        "cost_from": "waits" if waited is not None else "flops",
        "cost": lost / step_s,
        "steps": len(steps),
    }


def detect(run: RunTelemetry, summary: Summary, phases: list[RankPhases]) -> list[Finding]:
    layouts = {rank: t.expert_layout for rank, t in run.ranks.items() if t.expert_layout}
    if not layouts:
        return []
    layout = layouts[min(layouts)]
    ep = int(layout.get("ep") or 1)
    world = run.world_size
    if ep <= 1 or world % ep or any(rank not in run.ranks or not run.ranks[rank].experts for rank in range(world)):
        return []  # one rank computes every expert of its tokens: uneven experts cost no waiting between ranks
    # Under pipelining a group's ranks hold their own stage's layers: each group reads its first member's layout.
    groups = [
        g for g in (_group_cost(run, list(range(s, s + ep)), layouts.get(s, layout)) for s in range(0, world, ep)) if g
    ]
    if not groups:
        return []
    g = max(groups, key=lambda group: group["cost"])
    if g["load_excess"] < EXPERT_IMBALANCE_MIN:
        return []
    evidence = {
        "layer": g["layer"],
        "hot_rank": g["hot_rank"],
        "ep": ep,
        "group": g["members"],
        "load_excess": round(g["load_excess"], 4),
        "layer_load_ratio": g["layer_load_ratio"],
        "hottest_expert": g["hottest_expert"],
        "hottest_expert_share": round(g["hottest_expert_share"], 4),
        "num_experts": layout["num_experts"],
        "top_k": layout["top_k"],
        "dropped_fraction": round(g["dropped_fraction"], 4),
        "expert_flops_share": round(g["expert_flops_share"], 4),
        "lost_s_per_step": round(g["lost_s_per_step"], 6),
        "cost_from": g["cost_from"],
        "aux_loss_coef": layout.get("aux_loss_coef"),
        "capacity_factor": layout.get("capacity_factor"),
        # The overrides that set them (runs recorded before these keys: the built-in model's).
        "aux_loss_key": layout.get("aux_loss_key", "model.aux_loss_coef"),
        "capacity_key": layout.get("capacity_key", "model.capacity_factor"),
        "balanced_placement": g["balanced_placement"],
        "load_excess_balanced": round(g["load_excess_balanced"], 4),
        "steps": g["steps"],
    }
    message = (
        f"rank {g['hot_rank']} holds the hot experts (layer {g['layer']}: expert {g['hottest_expert']} gets "
        f"{pct(g['hottest_expert_share'])} of the assignments): its group computes {pct(g['load_excess'])} more "
        f"expert work on its busiest rank than on average, and every all-to-all waits for it"
    )
    basis = (
        "the group's mean wait at the all-to-alls that end the experts' compute, beyond its wait at the others"
        if g["cost_from"] == "waits"
        else "the busiest rank's expert work beyond its group's mean, per layer, at the experts' share of the model "
        "FLOPs of the measured compute time"
    )
    return [costed("expert_imbalance", [g["hot_rank"]], evidence, message, g["cost"], basis, metric=g["load_excess"])]


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
