"""expert_imbalance: under expert parallelism the rank holding the hot experts paces every all-to-all.

Each rank records, per step, the assignments its tokens sent to each expert of each layer (routed minus dropped:
what was computed). Summed over the ranks of an expert-parallel group, that is each group rank's expert load
per layer. Every layer's all-to-all waits for the group's most loaded rank, so per layer the step loses what
that rank computes beyond the mean rank: ``excess / mean`` of the layer's expert time.

The expert time comes from the FLOPs: the routed experts' share of the model's FLOPs per token
(``routed_flops_per_token / flops_per_token``) of the ranks' compute time. That compute time already holds the
waits for the hot rank (the all-to-alls block inside forward and backward), so with ``X`` the load excess over
the mean (summed over layers) and ``s`` the experts' share, the balanced compute is ``C / (1 + s X)`` and the
loss ``C s X / (1 + s X)``. The cost is that loss over the step time. It assumes expert GEMMs run at the
model's average FLOP rate; it says nothing about quality (dropped tokens are reported as evidence).
"""

from __future__ import annotations

from typing import Any

from diagnostics.analysis.expert_placement import as_placement, balanced_placement
from diagnostics.analysis.expert_placement import excess as excess_of
from diagnostics.analysis.finding import Finding, costed, pct
from diagnostics.analysis.load import RunTelemetry
from diagnostics.analysis.stats import mean
from diagnostics.analysis.thresholds import EXPERT_IMBALANCE_MIN, MIN_STEPS_AFTER_WARMUP, WARMUP_STEPS


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
    lost = compute * share * load_excess / (1.0 + share * load_excess)
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
        "cost": lost / step_s,
        "steps": len(steps),
    }


def detect_expert_imbalance(run: RunTelemetry) -> list[Finding]:
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
        "the busiest rank's expert work beyond its group's mean, per layer, at the experts' share of the model "
        "FLOPs of the measured compute time"
    )
    return [costed("expert_imbalance", [g["hot_rank"]], evidence, message, g["cost"], basis, metric=g["load_excess"])]
