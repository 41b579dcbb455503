"""Planner terms of mixture-of-experts models under expert parallelism (pure math, no torch).

The layout is the one ``strategy=fsdp strategy.ep=N`` builds (strategies/expert_parallel.py): groups of ``ep``
consecutive ranks each hold every expert once, ``E / ep`` per rank as stacked ``[E / ep, ...]`` tensors, which
FSDP2 shards on dim 0 over the ``world / ep`` ranks holding the same experts; everything else is FSDP-sharded over
the world. Tokens travel to their experts and back by all-to-all inside the group, in forward and in backward.

FLOPs per token count the ACTIVE parameters (router, top_k experts, shared experts): ``ModelShape.matmul_parameters``
already does, so MFU of an MoE run is against what a token computes, not against the total parameter count.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.config.hardware import HardwareProfile
from disttrain.planner.comm import LinkBytes, OpTraffic, link_time
from disttrain.planner.memory import compute_bytes
from disttrain.planner.shapes import ModelShape, expert_shard_dim, fsdp_shard_numel, model_flops_per_token
from disttrain.planner.spec import Workload

# fp32 master weights, fp32 gradients, Adam's two fp32 moments: bytes of training state per parameter (FSDP2 here).
STATE_BYTES_PER_PARAMETER = 16
# All-to-alls per MoE layer and micro-batch: forward exchanges the counts, dispatches and combines; backward runs
# the two token exchanges in reverse (the counts are not differentiated).
ALL_TO_ALL_CALLS = 5
TOKEN_EXCHANGES = 4  # dispatch + combine, forward and backward


@dataclass(frozen=True)
class ExpertLayout:
    """One expert-parallel degree: what a rank holds and what it sends per micro-batch."""

    ep: int
    expert_parameters: int  # routed-expert parameters one rank holds (its FSDP2 shard of its experts, all layers)
    dense_parameters: int  # every other parameter: its FSDP2 shard over the world
    all_to_all: LinkBytes  # bytes this rank sends per micro-batch, by link
    all_to_all_s: float  # their time per micro-batch at the profile's bandwidths and latencies

    @property
    def parameters(self) -> int:
        return self.expert_parameters + self.dense_parameters

    @property
    def state_bytes(self) -> int:
        """Parameters, gradients and Adam states this rank holds (fp32 master weights)."""
        return STATE_BYTES_PER_PARAMETER * self.parameters


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


def expert_layouts(shape: ModelShape, hw: HardwareProfile, workload: Workload) -> list[ExpertLayout]:
    """Every ``ep`` dividing both the experts and the world, with per-rank memory and all-to-all traffic."""
    world = hw.world_size
    if not shape.num_experts:
        return []
    layouts = []
    for ep in range(1, world + 1):
        if world % ep or shape.num_experts % ep:
            continue
        traffic = all_to_all_bytes(shape, workload, ep, hw.devices_per_node)
        seconds = link_time(traffic, hw, host_gbps=1.0) if traffic.network else 0.0
        layouts.append(
            ExpertLayout(
                ep,
                expert_parameters_per_rank(shape, ep, world),
                dense_parameters_per_rank(shape, world),
                traffic,
                seconds,
            )
        )
    return layouts


def active_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Model FLOPs per token of what a token computes (MFU's numerator for an MoE model)."""
    return model_flops_per_token(shape.matmul_parameters, shape.n_layers, shape.n_heads, shape.head_dim, seq_len)
