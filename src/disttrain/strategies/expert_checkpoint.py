"""Expert-parallel weights in the universal checkpoint: each rank's experts as its slice of the one-process tensor.

Under ``strategy.ep=N`` a rank holds ``blocks.<i>.mlp.experts.w1`` as ``[E / N, ...]`` (experts ``[k E / N, ...)``
of its group), FSDP2-sharded over the ``world / N`` ranks holding the same experts: a DTensor over that mesh whose
global shape is the group's slice, under the same name on every group. The universal layout stores one-process
names and shapes (``[E, ...]``), so before DCP sees them, each such tensor (and its Adam moments) is re-described,
without a copy, as what it is: a shard of the ``[E, ...]`` tensor over the world arranged as an ``(ep, edp)`` mesh,
split on dim 0 by the expert-parallel rank, then (on dim 0 or dim 1, as FSDP2 chose: ``planner.shapes
.expert_shard_dim``) by the expert-data-parallel rank. DCP then writes and reads the one-process tensor, and the same
checkpoint resumes at any ``ep`` (1 included) and under any other strategy. Loading fills the views in place, which
fills the model's and the optimizer's own shards (the views share their storage).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor, ShardedTensorMetadata, TensorProperties
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.remote_device import _remote_device
from torch.distributed.tensor import DTensor, Shard

from disttrain.models.moe import moe_layers
from disttrain.models.transformer import canonical_name


class ExpertSlice(NamedTuple):
    """How a rank's stacked expert weight sits in the one-process tensor."""

    ep: int
    ep_rank: int
    local: int  # experts per rank
    placement: list[int] | None  # slot -> global expert id (strategy.expert_placement); None: slot = id


def expert_parameter_names(module: nn.Module) -> dict[str, ExpertSlice]:
    """Fully qualified names of expert-parallel expert weights -> where this rank's rows sit in the whole tensor."""
    out: dict[str, ExpertSlice] = {}
    ids = {}
    for layer in moe_layers(module):
        if layer.ep_size > 1:
            local = layer.num_experts // layer.ep_size
            for w in layer.expert_weights():
                ids[id(w)] = ExpertSlice(layer.ep_size, layer.first_expert // local, local, layer.placement)
    for name, param in module.named_parameters():
        if id(param) in ids:
            # As get_model_state_dict names them: without the wrappers activation checkpointing or compile insert
            # (a wrapped name would match no key, and each rank would write its own experts as the whole tensor).
            out[canonical_name(name)] = ids[id(param)]
    return out


class ExpertViews:
    """Builds the one-process views of this rank's expert tensors (one world mesh per ``ep``, built once)."""

    def __init__(self, module: nn.Module) -> None:
        self.names = expert_parameter_names(module)
        self._meshes: dict[int, DeviceMesh] = {}

    def __bool__(self) -> bool:
        return bool(self.names)

    def _mesh(self, ep: int, device_type: str) -> DeviceMesh:
        if ep not in self._meshes:
            world = torch.distributed.get_world_size()
            # Ranks are edp_index x ep + ep_index (strategies/expert_parallel): as an (ep, edp) mesh, dim 0 splits
            # the experts and dim 1 the FSDP2 shard within them, in that nesting order.
            ranks = torch.arange(world).view(world // ep, ep).t()
            # Only a description for DCP's offsets: no process groups (nothing communicates over it).
            self._meshes[ep] = DeviceMesh(device_type, ranks, mesh_dim_names=("ep", "edp"), _init_backend=False)
        return self._meshes[ep]

    def view(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """``tensor`` (this rank's experts of ``name``, a DTensor over the edp mesh or plain) as a shard of the
        one-process ``[E, ...]`` tensor; other tensors (a scalar step count) unchanged."""
        ep, _, local, placement = self.names[name]
        whole = tensor.shape  # the group's slice [E / ep, ...] (a DTensor's global shape)
        if tensor.dim() == 0 or whole[0] != local:
            return tensor
        shard = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        fsdp_dim = 0
        if isinstance(tensor, DTensor) and isinstance(tensor.placements[0], Shard):
            fsdp_dim = tensor.placements[0].dim
        if placement is not None:
            return placed_view(shard, torch.Size(whole), fsdp_dim, ep, placement)
        shape = torch.Size((local * ep, *whole[1:]))
        stride = torch.empty(shape, device="meta").stride()
        mesh = self._mesh(ep, shard.device.type)
        return DTensor.from_local(shard, mesh, [Shard(0), Shard(fsdp_dim)], run_check=False, shape=shape, stride=stride)

    def model_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A model state dict (names as ``get_model_state_dict`` gives them) with the expert tensors as views."""
        return {k: self.view(v, k) if k in self.names else v for k, v in state.items()}

    def optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A flattened optimizer state dict (``state.<name>.<key>``) with the experts' moments as views."""
        out = {}
        for key, value in state.items():
            name = _parameter_of(key)
            out[key] = self.view(value, name) if name in self.names and torch.is_tensor(value) else value
        return out

    def read_back(self, state: dict[str, Any], viewed: dict[str, Any]) -> None:
        """After a load into ``viewed`` (``optimizer_state(state)``): the values a load replaces rather than fills
        (hyper-parameters, step counts) back into ``state``; the views filled ``state``'s tensors in place."""
        for key, value in viewed.items():
            if not (isinstance(value, (DTensor, ShardedTensor)) and _parameter_of(key) in self.names):
                state[key] = value


def _chunk(size: int, parts: int, index: int) -> range:
    """The indices ``torch.chunk`` (FSDP2's split) gives part ``index`` of ``parts`` along a dim of ``size``."""
    step = math.ceil(size / parts)
    return range(min(index * step, size), min((index + 1) * step, size))


def placed_layout(
    group_shape: torch.Size, fsdp_dim: int, ep: int, placement: list[int], world: int
) -> dict[int, list[tuple[int, ShardMetadata]]]:
    """rank -> (row of its local shard, where that row sits in the one-process ``[E, ...]`` tensor) for a placed
    expert weight: each rank holds the experts of its slots (``placement``), FSDP2-split over the ``world / ep``
    ranks holding the same experts along ``fsdp_dim`` (``torch.chunk``'s pieces), as the contiguous views assume.
    Together they tile the whole tensor once."""
    local, rest = group_shape[0], list(group_shape[1:])
    edp = world // ep
    out: dict[int, list[tuple[int, ShardMetadata]]] = {}
    for holder in range(world):
        edp_rank, ep_rank = divmod(holder, ep)
        piece = _chunk(group_shape[fsdp_dim], edp, edp_rank)
        if edp_rank >= edp or not len(piece):
            continue
        rows = piece if fsdp_dim == 0 else range(local)
        for row_index, row in enumerate(rows):
            offsets, sizes = [placement[ep_rank * local + row], *[0] * len(rest)], [1, *rest]
            if fsdp_dim > 0:
                offsets[fsdp_dim], sizes[fsdp_dim] = piece.start, len(piece)
            out.setdefault(holder, []).append((row_index, ShardMetadata(offsets, sizes, f"rank:{holder}/cpu")))
    return out


def placed_view(
    shard: torch.Tensor, group_shape: torch.Size, fsdp_dim: int, ep: int, placement: list[int]
) -> ShardedTensor:
    """This rank's piece of a placed expert weight as shards of the one-process ``[E, ...]`` tensor: one per held
    expert (a rank's experts are not contiguous there), each a view of ``shard`` (DCP writes from and loads into
    the model's own storage). Every rank describes the whole layout from the placement, so no collective runs."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    layout = placed_layout(group_shape, fsdp_dim, ep, placement, world)
    every, mine = [], []
    for holder, pieces in layout.items():
        for row_index, meta in pieces:
            meta.placement = _remote_device(f"rank:{holder}/{shard.device}")
            every.append(meta)
            if holder == rank:
                mine.append(LocalShard(shard[row_index : row_index + 1], meta))
    if sum(s.tensor.shape[0] for s in mine) != (shard.shape[0] if mine else 0):
        raise RuntimeError(f"placed expert shard {tuple(shard.shape)} does not match its layout ({len(mine)} rows)")
    whole = torch.Size((group_shape[0] * ep, *group_shape[1:]))
    properties = TensorProperties(dtype=shard.dtype, requires_grad=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        mine, ShardedTensorMetadata(every, whole, properties)
    )


def _parameter_of(key: str) -> str:
    """``state.<param name>.<key>`` -> the parameter name ('' for param_groups and other entries)."""
    if not key.startswith("state."):
        return ""
    return key[len("state.") :].rsplit(".", 1)[0]
