"""Gradient bookkeeping a 3D layout needs beyond what FSDP2 does: the global norm for clipping, and the tied
embedding whose two copies live on the first and the last pipeline stage.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def global_grad_norm(params: list[nn.Parameter], pp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The L2 norm of all gradients of the whole model, identical on every rank.

    Gradients are DTensors on different meshes (FSDP-only on the data-parallel axes, FSDP x TP on
    data-parallel x tp): each group's norm is computed by DTensor, which reduces over sharded axes only, so
    replicated copies are not double counted. Pipeline stages hold disjoint parameters: sum over ``pp_group``.
    """
    grads = [p.grad for p in params if p.grad is not None]
    by_mesh: dict[tuple, list[torch.Tensor]] = {}
    plain: list[torch.Tensor] = []
    for g in grads:
        if isinstance(g, DTensor):
            by_mesh.setdefault((id(g.device_mesh), g.placements), []).append(g)
        else:
            plain.append(g)
    device = grads[0].device if grads else torch.device("cpu")
    square = torch.zeros((), dtype=torch.float32, device=_local(grads[0]).device if grads else device)
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=False)
        square += norm.full_tensor().float() ** 2
    if plain:
        square += torch.nn.utils.get_total_norm(plain, norm_type=2.0, foreach=False).float() ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(square, group=pp_group)
    return square.sqrt()


@torch.no_grad()
def clip_grads_(params: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients exactly as ``torch.nn.utils.clip_grad_norm_`` does (same epsilon, clamp at 1)."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            _local(p.grad).mul_(coef.to(_local(p.grad).device, _local(p.grad).dtype))


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
        grads = [_local(p.grad) for p in self.local_params if p.grad is not None]
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
