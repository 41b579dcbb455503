"""strategy=fsdp: FSDP2 ``fully_shard`` on the data-parallel axis of a DeviceMesh.

Lightning's ModelParallelStrategy owns the process group and the mesh; ``apply_fsdp`` is the plan it runs in
``LightningModule.configure_model``: optional activation checkpointing, then one FSDP unit per transformer
block (so only one block's full parameters are live at a time), then the root for embeddings and head.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from disttrain.config.schema import PrecisionConfig
from disttrain.config.strategy_schema import FSDPConfig
from disttrain.models.transformer import _assign, canonical_name
from disttrain.planner.shapes import expert_shard_dim
from disttrain.strategies.checkpointing import UniversalCheckpointing
from disttrain.strategies.expert_parallel import apply_expert_parallel, expert_modules
from disttrain.strategies.loaders import ForkGuardedLoaders

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mixed_precision_policy(cfg: FSDPConfig, precision: PrecisionConfig) -> MixedPrecisionPolicy:
    """bf16-mixed (and fp8, whose other layers compute in bf16): bf16 all-gathers and compute, fp32 master weights,
    gradients reduced in reduce_dtype. Under fp8's tensorwise recipe torchao all-gathers the linear weights in fp8."""
    if precision.name in ("bf16-mixed", "fp8"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=DTYPES[cfg.reduce_dtype])
    return MixedPrecisionPolicy()


def trainer_precision(precision: PrecisionConfig) -> str:
    """FSDP2 casts parameters itself under bf16-mixed and fp8, so Lightning must not autocast on top of it."""
    return "32-true" if precision.name in ("bf16-mixed", "fp8") else precision.lightning


def hybrid_mesh(dp_mesh: DeviceMesh, replicas: int) -> DeviceMesh:
    """HSDP: the data-parallel ranks as ``replicas`` groups of consecutive ranks (a node's GPUs), parameters
    sharded within a group and replicated across groups (gradients all-reduced between them)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (replicas, dp_mesh.size() // replicas)
    return init_device_mesh(dp_mesh.device_type, shape, mesh_dim_names=("dp_replicate", "dp_shard"))


def apply_fsdp(
    model: nn.Module, mesh: object, cfg: FSDPConfig, precision: PrecisionConfig, apply_checkpointing: object
) -> None:
    dp_mesh = mesh["data_parallel"]  # type: ignore[index]
    if cfg.dp_replicate > 1:
        dp_mesh = hybrid_mesh(dp_mesh, cfg.dp_replicate)
    expert_mesh = apply_expert_parallel(model, dp_mesh, cfg.ep, cfg.expert_placement)
    if cfg.activation_checkpointing:
        apply_checkpointing(model)  # type: ignore[operator]
    options = {
        "mesh": dp_mesh,
        "mp_policy": mixed_precision_policy(cfg, precision),
        "offload_policy": CPUOffloadPolicy() if cfg.cpu_offload else None,
    }
    options = {k: v for k, v in options.items() if v is not None}
    expert_weights = {id(p) for experts in expert_modules(model) for p in experts.parameters()}
    blocks = getattr(model, "blocks", None)
    for block in blocks if blocks is not None else ():
        # Expert-parallel experts first, on their own mesh: the block's unit then leaves their parameters alone.
        if expert_mesh is not None:
            for experts in expert_modules(block):
                fully_shard(
                    experts,
                    reshard_after_forward=cfg.reshard_after_forward,
                    shard_placement_fn=expert_placement(expert_weights, expert_mesh.size()),
                    **{**options, "mesh": expert_mesh},
                )
        block_place = expert_placement(expert_weights, dp_mesh.size()) if expert_weights else None
        fully_shard(block, reshard_after_forward=cfg.reshard_after_forward, shard_placement_fn=block_place, **options)
    # The root's parameters (embeddings, final norm, head) are needed right after the last block in backward,
    # so resharding them after forward would only add an all-gather.
    fully_shard(model, reshard_after_forward=False, **options)
    maybe_materialize_shards(model, dp_mesh)


def expert_placement(expert_weights: set[int], shards: int) -> Callable[[nn.Parameter], Shard | None]:
    """FSDP2's shard dim for stacked expert weights (``planner.shapes.expert_shard_dim``); other parameters: dim 0."""

    def place(param: nn.Parameter) -> Shard | None:
        if id(param) not in expert_weights:
            return None
        return Shard(expert_shard_dim(tuple(param.shape), shards))

    return place


def maybe_materialize_shards(model: nn.Module, mesh: DeviceMesh) -> None:
    """A model sharded with deferred parameters (``model=hf``, built on the meta device) gets storage for this rank's
    shards only, then its starting values: the deterministic init drawn tensor by tensor on every rank (each keeps
    its shard, no communication), or ``model.path`` read by rank 0 alone and broadcast tensor by tensor
    (``set_model_state_dict(broadcast_from_rank0=True)``), so no rank but 0 reads the file or holds a full copy."""
    if not getattr(model, "deferred", False):
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
    # The buffers are real (RoPE tables, built with the structure) and to_empty would discard them.
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
        buffers = {canonical_name(name): buffer for name, buffer in buffers.items()}  # state_dict's names
        if model.path is None or model.expert_parallel:  # type: ignore[attr-defined]
            # Drawn on every rank; or, where ranks hold different experts (no one value to broadcast), every rank
            # reads its own tensors from model.path.
            for names, param in model.parameter_aliases():  # type: ignore[operator]
                _assign(param, model.initial_value(names, param.shape))  # type: ignore[operator]
            return
        full: dict[str, torch.Tensor] = {}
        if torch.distributed.get_rank() == 0:
            aliases = {name: names for names, _ in model.parameter_aliases() for name in names}  # type: ignore[operator]
            for key, value in model.state_dict().items():
                name = canonical_name(key).removeprefix("hf.")
                if name in aliases:
                    full[key] = model.initial_value(aliases[name], value.shape)  # type: ignore[operator]
                else:  # a persistent buffer: as constructed (today's models keep none in their files)
                    full[key] = buffers[canonical_name(key)]
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, full, options=options)


class FSDPStrategy(ForkGuardedLoaders, UniversalCheckpointing, ModelParallelStrategy):
    """ModelParallelStrategy (FSDP2 on a DeviceMesh) writing and reading the universal checkpoint layout."""

    def __init__(self, *args: Any, cpu_offload: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cpu_offload = cpu_offload

    def model_to_device(self) -> None:
        # fully_shard already placed every state (buffers on the mesh's device); under CPU offload the shards must
        # stay on the host, and Lightning's blanket ``model.to(gpu)`` would break FSDP2's offload at its lazy init.
        if not self.cpu_offload:
            super().model_to_device()


def build_fsdp(
    cfg: FSDPConfig, precision: PrecisionConfig, world_size: int, backend: str, apply_checkpointing: object
) -> tuple[FSDPStrategy, Callable[[Any, object], None]]:
    strategy = FSDPStrategy(
        data_parallel_size=world_size,
        tensor_parallel_size=1,
        save_distributed_checkpoint=True,
        process_group_backend=backend,
        cpu_offload=cfg.cpu_offload,
    )
    plan = partial(apply_fsdp, cfg=cfg, precision=precision, apply_checkpointing=apply_checkpointing)
    return strategy, plan
