"""Expert parallelism under FSDP2: the ``(edp, ep)`` mesh, this rank's experts, and who averages their gradients.

Ranks form groups of ``ep`` consecutive ranks (the ``ep`` axis); each group holds every expert once and exchanges
tokens by all-to-all inside the group. Ranks at the same place in different groups hold the same experts (the
``edp`` axis, ``world / ep`` ranks): the experts are FSDP-sharded and their gradients averaged over it, while the
dense parts stay FSDP-sharded over the whole data-parallel mesh as without experts.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from disttrain.models.moe import moe_layers, shard_experts


def apply_expert_parallel(
    model: nn.Module, dp_mesh: DeviceMesh, ep: int, placement: list[list[int]] | None = None
) -> DeviceMesh | None:
    """Keep this rank's experts (``placement``: which experts each rank of a group holds, per layer) and wire the
    groups; returns the mesh the experts are FSDP-sharded over (None when ``ep`` is 1 and the experts are plain
    block parameters). A dense model is left alone."""
    if not moe_layers(model):
        return None
    balance_group = dp_mesh.get_group()  # the balancing loss sees the counts of the whole data-parallel batch
    if ep == 1:
        shard_experts(model, 0, 1, None, balance_group)
        return None
    mesh = init_device_mesh(dp_mesh.device_type, (dp_mesh.size() // ep, ep), mesh_dim_names=("edp", "ep"))
    shard_experts(model, mesh["ep"].get_local_rank(), ep, mesh["ep"].get_group(), balance_group, placement)
    return mesh["edp"]


def expert_modules(module: nn.Module) -> list[nn.Module]:
    """The modules holding exactly the stacked expert weights of ``module``'s MoE layers (FSDP2 units of their own)."""
    return [layer.expert_module() for layer in moe_layers(module)]
