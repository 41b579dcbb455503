"""strategy=fsdp's terms: FSDP2 as ``disttrain.strategies.fsdp`` applies it, full shard, hybrid (HSDP) or with
expert parallelism.

Dim-0 shards (padded per tensor) of fp32 parameters, gradients and states; a per-layer working set of gathered 16-bit
parameters and unsharded gradients; the root unit (embeddings, head) is never resharded. Every block is a unit
gathered for forward (and again for backward when it reshards) and reduce-scattered in backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from disttrain.planner.breakdown import MemoryBreakdown
from disttrain.planner.comm import ALL_TO_ALL_CALLS, all_to_all_bytes, stage_tensors
from disttrain.planner.expert_shapes import (
    dense_shape,
    ep_shard_parameters,
    expert_parameters_per_rank,
    local_expert_parameters,
)
from disttrain.planner.links import ZERO, CommPlan, Group, LinkBytes, Sync, collective_bytes, combine
from disttrain.planner.memory import compute_bytes
from disttrain.planner.shapes import ModelShape
from disttrain.planner.spec import Layout, StrategyTerms, Workload, recompute_suffix


class FSDPTerms(StrategyTerms):
    name = "fsdp"
    optimizer_states_in_param_dtype = True
    runs_expert_parallel = True

    def check(self, layout: Layout) -> None:
        if layout.ep > 1 and (layout.dp_replicate > 1 or layout.dp % layout.ep):
            raise ValueError(f"ep={layout.ep} runs under FSDP2 full shard over a world it divides, not {layout}")

    def options(self, layout: Layout) -> dict[str, Any]:
        options: dict[str, Any] = {
            "reshard_after_forward": layout.reshard_after_forward,
            "activation_checkpointing": layout.recompute == "full",
            "cpu_offload": layout.offload_optimizer,
        }
        if layout.dp_replicate > 1:
            options["dp_replicate"] = layout.dp_replicate
        if layout.ep > 1:
            options["ep"] = layout.ep
        return options

    def label(self, layout: Layout) -> str:
        kind = f"hybrid {layout.dp_replicate}x{layout.dp_shard}" if layout.dp_replicate > 1 else "full shard"
        keep = "" if layout.reshard_after_forward else " no-reshard"
        offload = " +cpu-offload" if layout.offload_optimizer else ""
        experts = f" EP{layout.ep}" if layout.ep > 1 else ""
        return f"FSDP2 {kind}{experts}{keep}{offload}{recompute_suffix(layout)}"

    def model_states(self, shape: ModelShape, layout: Layout, workload: Workload, stage: int) -> MemoryBreakdown:
        precision = workload.precision
        p = 2 if precision == "bf16-true" else 4  # sharded (master) parameters, gradients and states
        gather = compute_bytes(precision)  # MixedPrecisionPolicy(param_dtype=bf16) under bf16-mixed
        reduce = 4 if precision in ("fp32", "bf16-mixed") else p  # reduce_dtype fp32 (the config default)
        shard = shape.fsdp_shard_parameters(layout.dp_shard)
        # The working set: the root unit stays gathered all step and its unsharded gradients live until the end of
        # backward; per block, the gathered current and prefetched unit (or every block without resharding) and one
        # block's unsharded gradient plus its reduce-scatter input.
        block = shape.block_parameters
        if layout.ep > 1:  # this rank's E / ep experts, sharded over the ranks holding them (planner/experts)
            shard = ep_shard_parameters(shape, layout.ep, layout.dp)
            block = block - shape.expert_parameters + local_expert_parameters(shape, layout.ep)
        gathered_blocks = 2 if layout.reshard_after_forward else shape.n_layers
        working = (
            shape.root_parameters * (gather + reduce) + gathered_blocks * block * gather + block * (gather + reduce)
        )
        if not shape.known and not layout.reshard_after_forward:
            # A raw count has no layers, but without resharding every parameter stays gathered from its forward to its
            # backward: the whole model in the compute dtype is a lower bound that follows from the count alone.
            working = shape.num_parameters * gather
        optimizer = round(shape.optimizer_states * p * shard)
        states = MemoryBreakdown(p * shard, p * shard, optimizer, 0, working, step_temporaries=p * shard)
        if layout.offload_optimizer:  # CPUOffloadPolicy: sharded parameters, gradients and the step live on the host
            host = states.params + states.grads + states.optimizer_states
            return MemoryBreakdown(0, 0, 0, 0, working, host=host)
        return states

    def comm(self, shape: ModelShape, layout: Layout, workload: Workload, groups: dict[str, Group]) -> CommPlan:
        if layout.ep > 1:  # the experts: their own units, groups and all-to-alls
            dense = self.comm(dense_shape(shape), dataclasses.replace(layout, ep=1), workload, groups)
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

    def optimizer_parameters(self, shape: ModelShape, layout: Layout) -> int:
        if layout.ep > 1:
            return ep_shard_parameters(shape, layout.ep, layout.dp)
        return shape.fsdp_shard_parameters(layout.dp_shard)


def expert_group(ep: int, world: int, devices_per_node: int) -> Group:
    """The ``world / ep`` ranks holding the same experts (every ``ep``-th rank), and how many share a node."""
    edp = world // ep
    return Group(edp, max(1, min(edp, devices_per_node // ep)))


def expert_parallel_comm(shape: ModelShape, layout: Layout, workload: Workload, devices_per_node: int) -> CommPlan:
    """What expert parallelism adds to the dense model's FSDP2 traffic per micro-batch (strategy=fsdp shards the
    dense parts over the world, ``FSDPTerms.comm`` on ``dense_shape``): every block's experts are an FSDP2 unit of
    their own over the ``world / ep`` ranks holding them (all-gathered for forward and, resharded, again for backward;
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
    if layout.offload_optimizer:  # as FSDPTerms.comm: shards up for each all-gather, gradients down
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
