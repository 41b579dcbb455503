"""A placement of experts on the ranks of an expert-parallel group that evens their measured load.

Every all-to-all of a layer waits for the group rank with the most assignments to compute, so the layer costs
its busiest rank's load. Given each expert's measured load, an even placement (each rank holding ``E / ep``
experts, as ``strategy.expert_placement`` requires) that minimises the busiest rank's load is a balanced
partition problem: the longest-processing-time rule (heaviest expert first, onto the least loaded rank with room)
followed by pairwise swaps that lower the busiest rank. Pure Python over the loads: the report proposes it as
``strategy.expert_placement`` and ``python -m diagnose RUN --ab`` measures it.
"""

from __future__ import annotations

from diagnostics.analysis.thresholds import PLACEMENT_MIN_CUT

# Swap passes over the busiest rank; each pass is O(E^2 / ep) comparisons, and a pass without a gain ends it.
MAX_SWAP_PASSES = 64


def busiest(loads: list[int], held: list[list[int]]) -> int:
    """The load of the busiest rank when rank ``j`` computes experts ``held[j]``."""
    return max(sum(loads[e] for e in experts) for experts in held)


def excess(per_expert: list[list[int]], held_by_layer: list[list[list[int]]]) -> float:
    """The busiest rank's load beyond the group's mean, summed over layers, over the mean summed over layers."""
    layers = list(zip(per_expert, held_by_layer, strict=True))
    over = sum(busiest(loads, held) - sum(loads) / len(held) for loads, held in layers)
    total = sum(sum(loads) / len(held) for loads, held in layers)
    return over / total if total else 0.0


def balance_layer(loads: list[int], ep: int) -> list[list[int]]:
    """``ep`` lists of ``len(loads) / ep`` expert ids whose largest summed load is as small as LPT + swaps find."""
    local = len(loads) // ep
    held: list[list[int]] = [[] for _ in range(ep)]
    sums = [0] * ep
    for expert in sorted(range(len(loads)), key=lambda e: (-loads[e], e)):
        room = [j for j in range(ep) if len(held[j]) < local]
        j = min(room, key=lambda r: (sums[r], r))
        held[j].append(expert)
        sums[j] += loads[expert]
    for _ in range(MAX_SWAP_PASSES):
        top = max(range(ep), key=lambda r: (sums[r], -r))
        best: tuple[int, int, int, int] | None = None  # (new busiest of the pair, other rank, out, in)
        for other in range(ep):
            if other == top:
                continue
            for out in held[top]:
                for into in held[other]:
                    moved = loads[out] - loads[into]
                    if moved <= 0:
                        continue
                    pair_max = max(sums[top] - moved, sums[other] + moved)
                    if pair_max < sums[top] and (best is None or pair_max < best[0]):
                        best = (pair_max, other, out, into)
        if best is None:
            break
        _, other, out, into = best
        held[top][held[top].index(out)] = into
        held[other][held[other].index(into)] = out
        moved = loads[out] - loads[into]
        sums[top] -= moved
        sums[other] += moved
    return [sorted(experts) for experts in held]


def balanced_placement(per_expert: list[list[int]], current: list[list[list[int]]]) -> list[list[list[int]]]:
    """Per layer, the balanced holding, or the current one where balancing removes less than
    ``PLACEMENT_MIN_CUT`` of the layer's busiest-rank excess (a layer within the loads' drift stays as it is)."""
    out = []
    for loads, held in zip(per_expert, current, strict=True):
        proposal = balance_layer(loads, len(held))
        now = busiest(loads, held)
        cut = now - busiest(loads, proposal)
        out.append(proposal if cut > 0 and cut >= PLACEMENT_MIN_CUT * (now - sum(loads) / len(held)) else held)
    return out


def as_placement(held_by_layer: list[list[list[int]]]) -> list[list[int]]:
    """Holdings per layer -> ``strategy.expert_placement``'s permutations (rank k's experts are its k-th block)."""
    return [[e for experts in held for e in experts] for held in held_by_layer]
