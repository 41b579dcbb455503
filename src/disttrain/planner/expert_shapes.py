"""Which parameters one rank holds under expert parallelism (``strategy=fsdp strategy.ep=N``; pure math).

Groups of ``ep`` consecutive ranks each hold every routed expert once, ``E / ep`` per rank as stacked
``[E / ep, ...]`` tensors, which FSDP2 shards over the ``world / ep`` ranks holding the same experts (on dim 0, or
dim 1 with fewer experts than ranks); everything else is FSDP-sharded over the world. Memory, communication, the
optimizer step and the candidates all count from here.
"""

from __future__ import annotations

import dataclasses

from disttrain.planner.shapes import ModelShape, expert_shard_dim, fsdp_shard_numel


def expert_parallel_degrees(shape: ModelShape, world: int) -> list[int]:
    """The ``ep > 1`` that ``strategy.ep`` accepts for this model and world (config/experts.py's rule): dividing
    both the experts and the world."""
    if not shape.num_experts:
        return []
    return [ep for ep in range(2, world + 1) if world % ep == 0 and shape.num_experts % ep == 0]


def expert_parameters_per_rank(shape: ModelShape, ep: int, world: int) -> int:
    """Routed-expert elements FSDP2 allocates on one rank: each ``[E / ep, ...]`` tensor sharded over the
    ``world / ep`` ranks holding the same experts (on dim 0, or dim 1 with fewer experts than ranks)."""
    shards = world // ep
    per_layer = 0
    for t in shape.block:
        if t.kind == "expert":
            local = (t.shape[0] // ep, *t.shape[1:])
            per_layer += fsdp_shard_numel(local, shards, expert_shard_dim(local, shards))
    return shape.n_layers * per_layer


def dense_parameters_per_rank(shape: ModelShape, world: int) -> int:
    block = sum(t.fsdp_numel(world) for t in shape.block if t.kind != "expert")
    return shape.n_layers * block + sum(t.fsdp_numel(world) for t in shape.embedding + shape.head)


def ep_shard_parameters(shape: ModelShape, ep: int, world: int) -> int:
    """Parameters one rank holds (and steps its optimizer over) under ``strategy.ep``: its FSDP2 shard of the
    dense parts over the world and of its experts over the ranks holding them."""
    return dense_parameters_per_rank(shape, world) + expert_parameters_per_rank(shape, ep, world)


def local_expert_parameters(shape: ModelShape, ep: int) -> int:
    """Routed-expert parameters of one block that one rank's experts hold, gathered (``E / ep`` experts)."""
    return shape.expert_parameters // ep


def dense_shape(shape: ModelShape) -> ModelShape:
    """The model without its routed experts: what FSDP2 shards over the whole world under expert parallelism."""
    block = tuple(t for t in shape.block if t.kind != "expert")
    removed = shape.n_layers * shape.expert_parameters
    return dataclasses.replace(
        shape, block=block, num_parameters=shape.num_parameters - removed, num_experts=0, top_k=0
    )
