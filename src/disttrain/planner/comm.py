"""Communication per step on one GPU: the process groups, the building blocks the strategies' terms share, and
``comm_plan``, which asks the layout's strategy (``StrategyTerms.comm``, planner/terms) which collectives it issues,
over which groups, with how many bytes and calls (priced by the link model, planner/links.py).

ZeRO-3/FSDP move 1.5x DDP's volume (forward and backward all-gathers plus a reduce-scatter, against one
all-reduce); Megatron's tensor parallelism all-reduces activations (or all-gathers and reduce-scatters them
under sequence parallelism, the same volume) twice per layer in forward and twice in backward.
"""

from __future__ import annotations

import dataclasses
import math

from disttrain.config.hardware import HardwareProfile
from disttrain.planner.links import CommPlan, Group, LinkBytes, OpTraffic, Sync
from disttrain.planner.memory import compute_bytes
from disttrain.planner.shapes import ModelShape, ParamTensor
from disttrain.planner.spec import Layout, Workload

# An MoE layer whose experts the tp ranks split (models/tensor_parallel.split_experts_over_tp): its output summed
# forward, its tokens' and gate weights' gradients summed backward.
TP_MOE_COLLECTIVES = 3


def tp_parallel_linears_per_layer(swiglu: bool, moe: bool = False, shared: bool = False) -> int:
    """DTensor linears of a block under strategy=megatron's TP plan: q, k, v, the output projection, w1, w2 (, w3);
    of an MoE block, the shared experts' MLP only (the routed experts are not DTensor modules)."""
    mlp = 3 if swiglu else 2
    return 4 + (mlp if shared or not moe else 0)


def tp_collectives_per_layer(swiglu: bool, moe: bool = False, shared: bool = False) -> int:
    """Activation-sized collectives of a block under TP: each row-parallel output forward, each column-parallel
    input's gradient backward; an MoE block's routed experts add ``TP_MOE_COLLECTIVES``."""
    mlp = 1 + (2 if swiglu else 1)  # a dense MLP: its output forward, w1's (and w3's) input gradient backward
    attention = 1 + 3
    if not moe:
        return attention + mlp
    return attention + TP_MOE_COLLECTIVES + (mlp if shared else 0)


def stage_tensors(shape: ModelShape, layers: int, root: tuple[ParamTensor, ...]) -> float:
    """Parameter tensors of ``layers`` blocks and the ``root`` tensors around them (0 for a raw parameter count,
    whose tensors are unknown)."""
    return float(layers * len(shape.block) + len(root)) if shape.known else 0.0


def process_groups(layout: Layout, hw: HardwareProfile) -> dict[str, Group]:
    """Groups in Megatron's rank order (tp fastest, then dp, then pp); FSDP hybrid shards within a node."""
    gpn = hw.devices_per_node
    tp_per_node = min(layout.tp, gpn)
    dp_per_node = max(1, min(layout.dp, gpn // layout.tp))
    pp_per_node = max(1, min(layout.pp, gpn // (layout.tp * layout.dp)))
    # The shard group is contiguous inside each replica (mesh order pp, dp_replicate, dp_shard, tp).
    shard_per_node = max(1, min(layout.dp_shard, gpn // layout.tp))
    replicate_per_node = max(1, min(layout.dp_replicate, gpn // (layout.tp * layout.dp_shard)))
    return {
        "tp": Group(layout.tp, tp_per_node),
        "dp": Group(layout.dp, dp_per_node),
        "pp": Group(layout.pp, pp_per_node),
        "dp_shard": Group(layout.dp_shard, shard_per_node),
        "dp_replicate": Group(layout.dp_replicate, replicate_per_node),
    }


# 1-bit Adam (strategies/onebit.py): the flat momentum in blocks of ONEBIT_BLOCK values, each sent as its signs
# (1 bit a value) and one fp32 scale, padded to whole blocks per rank.
ONEBIT_BLOCK = 512


def onebit_exchange_bytes(numel: int, world: int) -> int:
    """Bytes of ``numel`` momentum values compressed for ``world`` ranks: the buffer each exchange phase moves."""
    blocks_per_rank = max(1, math.ceil(numel / (world * ONEBIT_BLOCK)))
    return world * blocks_per_rank * (ONEBIT_BLOCK // 8 + 4)


# All-to-alls per MoE layer and micro-batch: forward exchanges the counts, dispatches and combines; backward runs
# the two token exchanges in reverse (the counts are not differentiated).
ALL_TO_ALL_CALLS = 5


TOKEN_EXCHANGES = 4  # dispatch + combine, forward and backward


def all_to_all_bytes(shape: ModelShape, workload: Workload, ep: int, devices_per_node: int) -> LinkBytes:
    """Token bytes one rank sends per micro-batch under uniform routing: of its ``tokens x top_k`` assignments
    (``d_model`` activations each), the ``(ep - 1) / ep`` routed to other ranks, four times per layer; the
    share for ranks on other nodes goes over the inter-node network."""
    if ep <= 1 or not shape.num_experts:
        return LinkBytes()
    tokens = workload.micro_batch_size * workload.seq_len
    sent = TOKEN_EXCHANGES * shape.n_layers * tokens * shape.top_k * shape.d_model * compute_bytes(workload.precision)
    per_node = min(ep, devices_per_node)
    intra = sent * (per_node - 1) / ep
    inter = sent * (ep - per_node) / ep
    calls = ALL_TO_ALL_CALLS * shape.n_layers
    intra_calls, inter_calls = (calls, 0.0) if inter == 0 else (0.0, calls)
    op = OpTraffic("all_to_all", intra, inter, intra_calls, inter_calls)
    return LinkBytes(intra, inter, 0.0, intra_calls, inter_calls, (op,))


def comm_plan(shape: ModelShape, layout: Layout, workload: Workload, hw: HardwareProfile) -> CommPlan:
    """What ``layout`` sends per step on one GPU, phase by phase."""
    groups = process_groups(layout, hw)
    plan = layout.terms.comm(shape, layout, workload, groups)
    if layout.world_size > 1:  # gradient reduction and the non-finite check end every step world-wide
        plan = dataclasses.replace(plan, step_syncs=(*plan.step_syncs, Sync(layout.world_size, 1)))
    return plan
