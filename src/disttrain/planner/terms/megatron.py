"""strategy=megatron's terms: tensor x pipeline x data parallelism, the pipeline rank's tensor-parallel slice under
FSDP2 on the data-parallel ranks as ``strategy.dp_type`` sets them (fsdp, hsdp, replicate); for comparison,
Megatron-LM's DDP with its distributed optimizer (6 + 12/d bytes per parameter, Megatron-Core "Distributed
Optimizer" docs) or without it (18).

Tensor parallelism all-reduces activations (or all-gathers and reduce-scatters them under sequence parallelism, the
same volume) twice per layer in forward and, per column-parallel input, in backward; pipeline stages send
activations and their gradients point to point.
"""

from __future__ import annotations

import math
from typing import Any

from disttrain.planner.breakdown import MemoryBreakdown
from disttrain.planner.bubble import stages_of_rank
from disttrain.planner.comm import stage_tensors, tp_collectives_per_layer, tp_parallel_linears_per_layer
from disttrain.planner.links import ZERO, CommPlan, Group, Sync, collective_bytes
from disttrain.planner.memory import ADAM_STATES, compute_bytes, rank_parameters
from disttrain.planner.shapes import ModelShape
from disttrain.planner.spec import (
    MEGATRON_DP_TYPES,
    MEGATRON_LM_DP_TYPES,
    Layout,
    StrategyTerms,
    Workload,
    recompute_suffix,
)

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


TP_COLLECTIVES_PER_RECOMPUTED_LAYER = 2


# Megatron pipeline stages keep send/recv buffers for forward activations and backward gradients.
PIPELINE_P2P_BUFFERS = 4


class MegatronTerms(StrategyTerms):
    name = "megatron"
    derived_options = frozenset({"dp"})  # the trainer derives dp from the world, tp and pp

    def check(self, layout: Layout) -> None:
        expected = {"fsdp": 1, "replicate": layout.dp}.get(layout.dp_type)
        if expected is not None and layout.dp_replicate != expected:
            raise ValueError(f"dp_type={layout.dp_type} needs dp_replicate={expected}, got {layout.dp_replicate}")

    def options(self, layout: Layout) -> dict[str, Any]:
        options: dict[str, Any] = {
            "tp": layout.tp,
            "pp": layout.pp,
            "dp": layout.dp,
            "sequence_parallel": layout.sequence_parallel,
            "activation_checkpointing": layout.recompute,
        }
        if layout.dp_type != "fsdp":  # the config's default
            options["dp_type"] = layout.dp_type
        if not layout.loss_parallel:  # the config's default is true
            options["loss_parallel"] = False
        if layout.dp_type == "hsdp":
            options["dp_replicate"] = layout.dp_replicate
        if layout.pp > 1:  # strategy=megatron ignores the schedule without pipelining
            options["schedule"] = layout.schedule
        options["microbatches"] = layout.microbatches
        if layout.schedule in ("interleaved_1f1b", "zero_bubble"):
            options["virtual_stages"] = layout.virtual_stages
        return options

    def label(self, layout: Layout) -> str:
        sp = " SP" if layout.sequence_parallel else ""
        schedule = ""
        if layout.pp > 1:
            v = f" v{layout.virtual_stages}" if layout.schedule in ("interleaved_1f1b", "zero_bubble") else ""
            schedule = f" {layout.schedule}{v} m{layout.microbatches}"
        dp = {"fsdp": "", "hsdp": f" hsdp {layout.dp_replicate}x{layout.dp_shard}", "replicate": " replicated"}
        dp |= {"distributed_optimizer": " Megatron-LM dist-opt", "replicated_optimizer": " Megatron-LM DDP"}
        return f"TP{layout.tp} PP{layout.pp} DP{layout.dp}{dp[layout.dp_type]}{sp}{schedule}{recompute_suffix(layout)}"

    def model_states(self, shape: ModelShape, layout: Layout, workload: Workload, stage: int) -> MemoryBreakdown:
        buffers = 0
        if layout.pp > 1:
            tokens = workload.micro_batch_size * workload.seq_len
            per_tensor = tokens * shape.d_model * compute_bytes(workload.precision) / layout.tp
            buffers = int(PIPELINE_P2P_BUFFERS * per_tensor)
        if layout.dp_type in MEGATRON_LM_DP_TYPES:
            return _megatron_lm_states(shape, layout, workload, stage, buffers)
        # strategy=megatron: FSDP2 over the dp_shard ranks of each TP x pipeline slice (a shard group of one under
        # dp_type=replicate), params in their dtype, bf16 gathers under bf16-mixed, fp32 gradient reduction.
        precision = workload.precision
        p = 2 if precision == "bf16-true" else 4
        gather, reduce = compute_bytes(precision), 4
        stages = stages_of_rank(stage, layout.pp, layout.virtual_stages, layout.schedule)
        num_stages = layout.pp * len(stages)
        n = shape.pipeline_rank_parameters(layout.tp, layout.pp, stages, num_stages)
        shard = shape.pipeline_rank_parameters(layout.tp, layout.pp, stages, num_stages, layout.dp_shard)
        root = sum(t.tp_numel(layout.tp) for s in stages for t in shape.stage_root(num_stages, s))
        block = shape.block_tp_numel(layout.tp)
        if layout.pp > 1:
            # The engine keeps gathered weights under pipelining (every micro-batch's backward comes later): the whole
            # rank in the compute dtype, plus one block's unsharded gradient and the root's until the step.
            working = n * gather + block * (gather + reduce) + root * reduce
        else:  # blocks reshard after forward, the root never does: as strategy=fsdp
            working = root * (gather + reduce) + 2 * block * gather + block * (gather + reduce)
        return MemoryBreakdown(
            p * shard, p * shard, ADAM_STATES * p * shard, 0, working + buffers, step_temporaries=p * shard
        )

    def comm(self, shape: ModelShape, layout: Layout, workload: Workload, groups: dict[str, Group]) -> CommPlan:
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

    def optimizer_parameters(self, shape: ModelShape, layout: Layout) -> int:
        stage = max(rank_parameters(shape, layout, rank) for rank in (0, layout.pp - 1))
        # FSDP2 steps its dp_shard shard (the whole slice under dp_type=replicate); Megatron-LM's distributed optimizer
        # steps its dp shard, its plain DDP the whole slice.
        shards = {"distributed_optimizer": layout.dp, "replicated_optimizer": 1}.get(layout.dp_type, layout.dp_shard)
        return math.ceil(stage / shards)


def _megatron_lm_states(
    shape: ModelShape, layout: Layout, workload: Workload, stage: int, buffers: int
) -> MemoryBreakdown:
    """Megatron-LM's DDP: 16-bit parameters and fp32 main gradients on every dp rank; fp32 master weights (when
    params are 16-bit), momentum and variance sharded over dp by the distributed optimizer or replicated without
    it (Megatron-Core "Distributed Optimizer" docs: 6 + 12/d and 18 bytes per parameter for bf16)."""
    n = rank_parameters(shape, layout, stage)
    p = 4 if workload.precision == "fp32" else 2
    master = 0 if workload.precision == "fp32" else 4
    optimizer_dp = layout.dp if layout.dp_type == "distributed_optimizer" else 1
    optimizer = math.ceil((master + ADAM_STATES * 4) * n / optimizer_dp)
    return MemoryBreakdown(p * n, 4 * n, optimizer, 0, buffers)
