"""Gradient bookkeeping a 3D layout needs beyond what FSDP2 does: the global norm for clipping, and the tied
embedding whose two copies live on the first and the last pipeline stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what a pipeline stage passes on, as torch's PipelineStage does), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def global_grad_norm(params: list[nn.Parameter], ranks_per_stage: int, device: torch.device) -> torch.Tensor:
    """The L2 norm of all gradients of the whole model, identical on every rank, in one all-reduce over the world.

    Every rank of a pipeline stage holds all of the stage's parameters, each gradient split into as many shards
    as the product of the sizes of the mesh axes it is sharded on (FSDP's data-parallel axes, TP's), each shard
    held by ``ranks_per_stage / shards`` ranks. Each rank adds its shards' squares divided by that count, so the
    sum over the world counts every element once, stages included (they hold disjoint parameters). One blocking
    collective a step instead of one per (mesh, placements) group and another over the pipeline: each of them
    waits for the slowest rank.
    """
    by_holders: dict[int, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_holders.setdefault(_holders_per_shard(p.grad, ranks_per_stage), []).append(local_tensor(p.grad))
    square = torch.zeros((), dtype=torch.float32, device=device)
    for holders, group in sorted(by_holders.items()):
        square += torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=False).float().square() / holders
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(square)
    return square.sqrt()


def _holders_per_shard(grad: torch.Tensor, ranks_per_stage: int) -> int:
    """How many ranks of a stage hold the same shard of ``grad``: the stage's ranks over its number of shards."""
    if not isinstance(grad, DTensor):
        return ranks_per_stage
    shards = 1
    for axis, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError(f"a gradient with a pending reduction ({grad.placements}) has no norm of its own yet")
        if not placement.is_replicate():  # Shard, and FSDP's strided shard under TP (not a Shard subclass)
            shards *= grad.device_mesh.size(axis)
    return ranks_per_stage // shards


@torch.no_grad()
def clip_grads_(params: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients exactly as ``torch.nn.utils.clip_grad_norm_`` does (same epsilon, clamp at 1)."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            local_tensor(p.grad).mul_(coef.to(local_tensor(p.grad).device, local_tensor(p.grad).dtype))


class TiedEmbeddingSync:
    """Keeps the first stage's ``tok_emb.weight`` and the last stage's ``lm_head.weight`` one parameter.

    Both copies start equal (same init seed) and must get the sum of both gradients before every optimizer
    step (Megatron's embedding group). ``group`` joins the two pipeline ranks holding them, or is None when one
    rank holds both (the V schedule puts the first and the last stage on pipeline rank 0).
    """

    def __init__(self, local_params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
        self.local_params = local_params
        self.group = group

    @torch.no_grad()
    def sync(self) -> None:
        grads = [local_tensor(p.grad) for p in self.local_params if p.grad is not None]
        if not grads:
            return
        total = grads[0].clone()
        for g in grads[1:]:
            total += g
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for g in grads:
            g.copy_(total)


def tied_embedding_group(mesh_ranks: torch.Tensor, my_rank: int) -> dist.ProcessGroup | None:
    """The group joining the first and the last pipeline rank at this rank's other mesh coordinates.

    ``mesh_ranks`` is the mesh's rank tensor with the pipeline axis first. ``new_group`` is collective, so every
    rank creates every pair group in the same order and keeps its own. None with one pipeline rank.
    """
    if mesh_ranks.shape[0] == 1:
        return None
    firsts, lasts = mesh_ranks[0].flatten().tolist(), mesh_ranks[-1].flatten().tolist()
    mine = None
    for first, last in zip(firsts, lasts, strict=True):
        group = dist.new_group(sorted((first, last)))
        if my_rank in (first, last):
            mine = group
    return mine


def stage_group(mesh_ranks: torch.Tensor, my_rank: int) -> dist.ProcessGroup:
    """The group of every rank holding this rank's pipeline stage (all its data- and tensor-parallel coordinates).

    ``mesh_ranks`` has the pipeline axis first. ``new_group`` is collective: every rank creates every stage's group
    in the same order and keeps its own."""
    mine = None
    for stage in mesh_ranks:
        ranks = sorted(stage.flatten().tolist())
        group = dist.new_group(ranks)
        if my_rank in ranks:
            mine = group
    assert mine is not None, f"rank {my_rank} is in no pipeline stage of the mesh"
    return mine
