"""Communication per step on one GPU for each strategy's layout: which collectives it issues, over which groups, with
how many bytes and calls (priced by the link model, planner/links.py).

ZeRO-3/FSDP move 1.5x DDP's volume (forward and backward all-gathers plus a reduce-scatter, against one
all-reduce); Megatron's tensor parallelism all-reduces activations (or all-gathers and reduce-scatters them
under sequence parallelism, the same volume) twice per layer in forward and twice in backward.
"""

from __future__ import annotations

import dataclasses
import math

from disttrain.config.hardware import HardwareProfile
from disttrain.planner.expert_shapes import dense_shape, expert_parameters_per_rank, local_expert_parameters
from disttrain.planner.links import ZERO, CommPlan, Group, LinkBytes, OpTraffic, Sync, collective_bytes, combine
from disttrain.planner.memory import compute_bytes, rank_parameters
from disttrain.planner.shapes import ModelShape, ParamTensor
from disttrain.planner.spec import MEGATRON_DP_TYPES, Layout, Workload

# Activation collectives per transformer layer and micro-batch under TP (in all-reduce equivalents), as
# strategy=megatron runs them: two in forward (the row-parallel attention output and MLP output projections),
# and in backward one per column-parallel input projection (q, k and v are separate modules, then w1, and w3
# under SwiGLU: each sums its input gradient over the TP group itself); full recomputation repeats the forward
# two. Megatron-LM fuses QKV and the MLP's input projections, which makes it four per layer. tp_collectives_per_layer
# counts them.
# Vocab-parallel cross-entropy (``strategy.loss_parallel`` under tp > 1, on the stage holding the head): forward
# reduces each token's logit max, sum of exponentials and target logit over the TP group, one fp32 value per token
# each (what the profiler shows as three [tokens, 1] all-reduces per micro-batch); its backward is local.
LOSS_PARALLEL_COLLECTIVES = 3


DDP_BUCKET_BYTES = 25 * 2**20  # strategy.bucket_cap_mb's default: one all-reduce call per bucket


TP_COLLECTIVES_PER_RECOMPUTED_LAYER = 2


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


def _ddp(shape: ModelShape, layout: Layout, workload: Workload, groups: dict[str, Group]) -> CommPlan:
    if layout.onebit_adam:
        # The compressed momentum to each chunk's server (all-to-all), the servers' averages back (all-gather):
        # both after backward, inside the optimizer step, so nothing hides them.
        exchange = onebit_exchange_bytes(shape.num_parameters, layout.dp)
        dp = groups["dp"]
        return CommPlan(
            step_exposed=collective_bytes("all_to_all", exchange, dp) + collective_bytes("all_gather", exchange, dp)
        )
    grad_bytes = (2 if workload.precision == "bf16-true" else 4) * shape.num_parameters
    # Lightning skips the all-reduce on accumulation micro-batches (no_sync): once per step, one call per bucket.
    buckets = math.ceil(grad_bytes / DDP_BUCKET_BYTES)
    return CommPlan(step_bwd=collective_bytes("all_reduce", grad_bytes, groups["dp"], buckets))


def _fsdp(shape: ModelShape, layout: Layout, workload: Workload, groups: dict[str, Group]) -> CommPlan:
    if layout.ep > 1:  # the experts: their own units, groups and all-to-alls
        dense = _fsdp(dense_shape(shape), dataclasses.replace(layout, ep=1), workload, groups)
        gpn = groups["dp"].per_node
        experts = expert_parallel_comm(shape, layout, workload, gpn)
        return combine(dense, experts)
    precision, n = workload.precision, layout.dp_shard
    gather = compute_bytes(precision)
    reduce = 4 if precision in ("fp32", "bf16-mixed") else 2
    shard = shape.fsdp_shard_parameters(n)
    block_shards = shape.n_layers * shape.fsdp_block_shard_parameters(n) if shape.known else shard
    group = groups["dp_shard"]
    units = shape.n_layers + 1 if shape.known else 1  # a unit per block, then the root: one call each
    forward = collective_bytes("all_gather", n * shard * gather, group, units)
    backward = collective_bytes("reduce_scatter", n * shard * reduce, group, units)
    if layout.reshard_after_forward:  # the root is never resharded, blocks are gathered again
        backward += collective_bytes("all_gather", n * block_shards * gather, group, max(1, units - 1))
    if layout.dp_replicate > 1:  # HSDP: reduced shards are then all-reduced across replicas
        backward += collective_bytes("all_reduce", shard * reduce, groups["dp_replicate"], units)
    # Backward ends waiting for the last reduce-scatter; every other per-unit collective waits as far as it is not
    # hidden behind compute.
    calls = forward.intra_calls + forward.inter_calls + backward.intra_calls + backward.inter_calls
    syncs = (Sync(n, 1), Sync(n, max(0.0, calls - 1), hideable=True)) if n > 1 else ()
    # Lightning's ModelParallelStrategy does not pause gradient sync while accumulating: every micro-batch gathers
    # and reduces, and copies what it gathers and reduces.
    regathered = n * block_shards * gather if layout.reshard_after_forward else 0
    copies = n * shard * (gather + reduce) + regathered
    plan = CommPlan(
        mb_fwd=forward,
        mb_bwd=backward,
        mb_syncs=syncs,
        mb_fsdp_units=units,
        mb_fsdp_copy_bytes=copies,
        step_fsdp_tensors=stage_tensors(shape, shape.n_layers, shape.embedding + shape.head),
    )
    if not layout.offload_optimizer:
        return plan
    p = 2 if precision == "bf16-true" else 4
    gathers = 2 if layout.reshard_after_forward else 1
    host = LinkBytes(host=p * shard * (gathers + 1))  # shards up for each all-gather, gradients down
    return dataclasses.replace(plan, mb_exposed=host, host_optimizer_parameters=shard)


def _deepspeed(shape: ModelShape, layout: Layout, workload: Workload, groups: dict[str, Group]) -> CommPlan:
    n, dp, stage = shape.num_parameters, layout.dp, layout.zero_stage
    p16 = g16 = 4 if workload.precision == "fp32" else 2
    group = groups["dp"]
    # ZeRO-1/2 reduce each gradient bucket with one all-reduce and keep their own partition of the result
    # (DeepSpeed's zero_optimization.use_multi_rank_bucket_allreduce, on by default in 0.19: a ZeRO-2 profile here
    # showed gloo all-reduces and no reduce-scatter); ZeRO-3 reduce-scatters its partitioned gradients.
    reduce = collective_bytes("all_reduce" if stage < 3 else "reduce_scatter", g16 * n, group)
    gather = collective_bytes("all_gather", p16 * n, group)
    shard = math.ceil(n / dp)
    host_step, host_mb = ZERO, ZERO
    if layout.offload_optimizer:
        # Gradient partitions go down (every micro-batch once gradients are partitioned), params come back up.
        grads_down = LinkBytes(host=g16 * shard)
        host_step = LinkBytes(host=p16 * shard) + (grads_down if stage == 1 else ZERO)
        host_mb = ZERO if stage == 1 else grads_down
    if layout.offload_params:  # each rank fetches its partition before the forward and backward all-gathers
        host_mb += LinkBytes(host=2 * p16 * shard)
    host_params = shard if layout.offload_optimizer else 0
    # NVMe (stage 3 only): the fp32 master, momentum and variance in and out around the step; the parameter
    # partition read before forward and backward and written back after the step.
    nvme_step = 2 * 12 * shard if layout.nvme_optimizer else 0
    nvme_step += p16 * shard if layout.nvme_params else 0
    nvme_mb = 2 * p16 * shard if layout.nvme_params else 0
    syncs = (Sync(dp, 1),) if stage > 1 and dp > 1 else ()  # stages 2/3 reduce (and wait) every micro-batch
    if stage == 1:
        return CommPlan(
            mb_exposed=host_mb, step_bwd=reduce, step_exposed=gather + host_step, host_optimizer_parameters=host_params
        )
    if stage == 2:
        return CommPlan(
            mb_bwd=reduce,
            mb_exposed=host_mb,
            step_exposed=gather + host_step,
            host_optimizer_parameters=host_params,
            mb_syncs=syncs,
        )
    return CommPlan(
        mb_fwd=gather,
        mb_bwd=gather + reduce,
        mb_exposed=host_mb,
        step_exposed=host_step,
        host_optimizer_parameters=host_params,
        mb_syncs=syncs,
        nvme_step_bytes=nvme_step,
        nvme_mb_bytes=nvme_mb,
    )


def _megatron(shape: ModelShape, layout: Layout, workload: Workload, groups: dict[str, Group]) -> CommPlan:
    tp, pp, precision = layout.tp, layout.pp, workload.precision
    activation = workload.micro_batch_size * workload.seq_len * shape.d_model * compute_bytes(precision)
    moe = shape.num_experts > 0
    per_layer = tp_collectives_per_layer(shape.swiglu, moe, shape.shared_experts)
    per_layer += TP_COLLECTIVES_PER_RECOMPUTED_LAYER if layout.recompute == "full" else 0
    # The busiest stage also reduces the embedding output (first stage) and the head's input (last stage).
    edge_collectives = 2 if pp == 1 else 1
    tp_count = per_layer * (shape.n_layers // pp) + edge_collectives
    # The vocab-parallel embedding (first stage) and the column-parallel head (last stage) are DTensor modules too.
    tp_modules = tp_parallel_linears_per_layer(shape.swiglu, moe, shape.shared_experts) * (shape.n_layers // pp)
    tp_modules += edge_collectives
    tp_modules = tp_modules if tp > 1 else 0
    exposed = tp_traffic = collective_bytes("functional_all_reduce", activation, groups["tp"]).scale(tp_count)
    loss_count = 0
    if tp > 1:  # the loss on the head's vocab-sharded logits: reduce per-token statistics, or gather the logits
        tokens = workload.micro_batch_size * workload.seq_len
        if layout.loss_parallel:
            loss_count = LOSS_PARALLEL_COLLECTIVES
            loss = collective_bytes("functional_all_reduce", 4 * tokens, groups["tp"]).scale(loss_count)
        else:
            loss_count = 1
            logits = tokens * shape.vocab_size * compute_bytes(precision)
            loss = collective_bytes("all_gather", logits, groups["tp"])
        exposed = tp_traffic = tp_traffic + loss
    syncs = [Sync(tp, tp_count + loss_count)] if tp > 1 else []
    chunks = layout.virtual_stages if layout.schedule in ("interleaved_1f1b", "zero_bubble") else 1
    if pp > 1:
        message = activation / tp if layout.sequence_parallel else activation
        exposed += collective_bytes("p2p", message, groups["pp"]).scale(2 * chunks)  # forward and backward
        syncs.append(Sync(2, 2 * chunks))  # a receive waits for its neighbour's send
    stage_params = max(rank_parameters(shape, layout, 0), rank_parameters(shape, layout, pp - 1))
    param_bytes = compute_bytes(precision)
    mb_fwd = mb_bwd = ZERO
    fsdp_units, fsdp_copies, fsdp_tensors = 0.0, 0.0, 0.0
    if layout.dp_type == "replicated_optimizer":  # Megatron-LM DDP without its distributed optimizer
        grads, params = collective_bytes("all_reduce", 4 * stage_params, groups["dp"]), ZERO
    elif layout.dp_type == "distributed_optimizer":
        grads = collective_bytes("reduce_scatter", 4 * stage_params, groups["dp"])  # fp32 main gradients
        params = collective_bytes("all_gather", param_bytes * stage_params, groups["dp"])
    else:  # FSDP2 over dp_shard (size 1 under dp_type=replicate), then an all-reduce of the shard over replicas
        shard_group, n = groups["dp_shard"], layout.dp_shard
        layers = shape.n_layers // pp
        units = layers + 1 if shape.known else 1  # a unit per block of the stage, then the stage's root
        grads = collective_bytes("reduce_scatter", 4 * stage_params, shard_group, units)
        grads += collective_bytes("all_reduce", 4 * math.ceil(stage_params / n), groups["dp_replicate"], units)
        params = collective_bytes("all_gather", param_bytes * stage_params, shard_group, units)
        # The engine wraps every chunk's blocks and the chunk itself, whatever dp_shard is: one root per chunk.
        fsdp_units = layers + chunks if shape.known else chunks
        if tp == 1:  # a tensor-parallel block's DTensor tail is measured as such (hw.tp_step_overhead_us)
            fsdp_tensors = max(stage_tensors(shape, layers, shape.stage_root(pp, s)) for s in (0, pp - 1))
        # Gradients reduce (and their buffers fill) once per step; under pipelining the weights gather once too.
        fsdp_copies = (param_bytes + 4) * stage_params / layout.microbatches
        if pp == 1:
            # Without pipelining the engine reshards blocks after forward (as strategy=fsdp does): every micro-batch
            # gathers all weights for its forward and the blocks' again for its backward; gradients reduce once.
            blocks = shape.n_layers * shape.block_tp_numel(tp) if shape.known else stage_params
            block_gathers = collective_bytes("all_gather", param_bytes * blocks, shard_group, max(1, layers))
            mb_fwd, mb_bwd = params, block_gathers
            params = ZERO
            fsdp_copies = param_bytes * (stage_params + blocks) + 4 * stage_params / layout.microbatches
    step_exposed = ZERO
    # The two copies of a tied embedding all-reduce their gradients, except under the V schedule, whose rank 0
    # holds both copies and sums them locally (``TiedEmbeddingSync``).
    if shape.tied_embeddings and pp > 1 and layout.schedule != "zero_bubble":
        tied = sum(t.tp_numel(tp) for t in shape.embedding if t.kind == "tied")
        pair = Group(2, 2 if groups["pp"].per_node >= pp else 1)
        step_exposed = collective_bytes("all_reduce", 4 * tied, pair)
    if layout.dp_type in MEGATRON_DP_TYPES and layout.dp_shard > 1 and pp == 1:
        syncs.append(Sync(layout.dp_shard, 1))  # as strategy=fsdp: every micro-batch waits for its reduce-scatter
    return CommPlan(
        mb_fwd,
        mb_bwd,
        exposed,
        step_fwd=params,
        step_bwd=grads,
        step_exposed=step_exposed,
        mb_syncs=tuple(syncs),
        mb_tp_modules=tp_modules,
        mb_tp_edges=edge_collectives / 2 if tp > 1 else 0.0,
        mb_fsdp_units=fsdp_units,
        mb_fsdp_copy_bytes=fsdp_copies,
        step_fsdp_tensors=fsdp_tensors,
        mb_tp=tp_traffic if tp > 1 else ZERO,
    )


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


def expert_group(ep: int, world: int, devices_per_node: int) -> Group:
    """The ``world / ep`` ranks holding the same experts (every ``ep``-th rank), and how many share a node."""
    edp = world // ep
    return Group(edp, max(1, min(edp, devices_per_node // ep)))


def expert_parallel_comm(shape: ModelShape, layout: Layout, workload: Workload, devices_per_node: int) -> CommPlan:
    """What expert parallelism adds to the dense model's FSDP2 traffic per micro-batch (strategy=fsdp shards the
    dense parts over the world, ``_fsdp`` on ``dense_shape``): every block's experts are an FSDP2 unit of their own
    over the ``world / ep`` ranks holding them (all-gathered for forward and, resharded, again for backward;
    gradients reduce-scattered; under CPU offload their shards and optimizer step on the host like the dense
    parts'), and the token all-to-alls, which the experts wait for: on the critical path, each a sync of the ``ep``
    group."""
    ep, world, reshard = layout.ep, layout.dp, layout.reshard_after_forward
    gather = compute_bytes(workload.precision)
    reduce = 4 if workload.precision in ("fp32", "bf16-mixed") else 2
    layers = shape.n_layers
    experts = layers * local_expert_parameters(shape, ep)
    group = expert_group(ep, world, devices_per_node)
    forward = collective_bytes("all_gather", gather * experts, group, layers)
    backward = collective_bytes("reduce_scatter", reduce * experts, group, layers)
    regathered = gather * experts if reshard else 0
    if reshard:
        backward += collective_bytes("all_gather", regathered, group, layers)
    host, host_parameters = ZERO, 0
    if layout.offload_optimizer:  # as _fsdp: shards up for each all-gather, gradients down
        host_parameters = expert_parameters_per_rank(shape, ep, world)
        p = 2 if workload.precision == "bf16-true" else 4
        host = LinkBytes(host=p * host_parameters * ((2 if reshard else 1) + 1))
    return CommPlan(
        mb_fwd=forward,
        mb_bwd=backward,
        mb_exposed=all_to_all_bytes(shape, workload, ep, devices_per_node) + host,
        host_optimizer_parameters=host_parameters,
        mb_syncs=(Sync(ep, ALL_TO_ALL_CALLS * layers),),
        mb_fsdp_units=layers,
        mb_fsdp_copy_bytes=experts * (gather + reduce) + regathered,
    )


def comm_plan(shape: ModelShape, layout: Layout, workload: Workload, hw: HardwareProfile) -> CommPlan:
    """What ``layout`` sends per step on one GPU, phase by phase."""
    groups = process_groups(layout, hw)
    builders = {"ddp": _ddp, "fsdp": _fsdp, "deepspeed": _deepspeed, "megatron": _megatron}
    if layout.strategy not in builders:
        raise ValueError(f"unknown strategy {layout.strategy!r}")
    plan = builders[layout.strategy](shape, layout, workload, groups)
    if layout.world_size > 1:  # gradient reduction and the non-finite check end every step world-wide
        plan = dataclasses.replace(plan, step_syncs=(*plan.step_syncs, Sync(layout.world_size, 1)))
    return plan
