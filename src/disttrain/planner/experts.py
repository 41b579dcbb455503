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
from disttrain.planner.comm import ALL_TO_ALL_CALLS, TOKEN_EXCHANGES, all_to_all_bytes
from disttrain.planner.expert_shapes import dense_parameters_per_rank, expert_parameters_per_rank
from disttrain.planner.links import LinkBytes, link_time
from disttrain.planner.shapes import ModelShape, model_flops_per_token
from disttrain.planner.spec import Workload

# fp32 master weights, fp32 gradients, Adam's two fp32 moments: bytes of training state per parameter (FSDP2 here).
STATE_BYTES_PER_PARAMETER = 16


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


__all__ = [
    "ALL_TO_ALL_CALLS",
    "TOKEN_EXCHANGES",
    "ExpertLayout",
    "active_flops_per_token",
    "all_to_all_bytes",
    "dense_parameters_per_rank",
    "expert_layouts",
    "expert_parameters_per_rank",
]
