"""strategy=fsdp for a user's LightningModule: FSDP2 units chosen by class or by size, the top-level children last.

The built-in models name their blocks; a user's module does not, so the units are the instances of
``strategy.fsdp_wrap``'s classes or, without it, every module holding at least ``strategy.fsdp_unit_min_params``
parameters not already in a unit below it (torch's size-based policy, bottom-up). Only one unit's full parameters
are live at a time. The roots are the module's top-level children: FSDP2 gathers a module's parameters in its
forward hooks, and Lightning calls ``training_step``, not the LightningModule's own forward, so a root on the
LightningModule itself would never gather. Containers are looked into, their members the roots and the units:
ModuleList and ModuleDict have no forward of their own, and a Sequential's is skipped as often as it runs (user
code indexes and slices it: ``self.body[0](x)``, ``self.features[:4](x)``, calling the members, never the
Sequential). A parameter held by the LightningModule itself has no forward to gather it in: it is refused with the
fix. A module whose own forward the code bypasses in another way (calling ``self.encoder.layer1`` directly) needs
its called submodules named in ``strategy.fsdp_wrap``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn

from disttrain.config.errors import ConfigError
from disttrain.config.schema import PrecisionConfig
from disttrain.config.strategy_schema import FSDPConfig
from disttrain.models.targets import resolve_target

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def wrap_classes(fsdp: FSDPConfig) -> tuple[type, ...]:
    """``strategy.fsdp_wrap``'s classes, imported (one line naming a path that is not a module class)."""
    classes: list[type] = []
    for index, path in enumerate(fsdp.fsdp_wrap or ()):
        obj = resolve_target(path, f"strategy.fsdp_wrap[{index}]")
        if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
            raise ConfigError(
                f"strategy.fsdp_wrap[{index}]", f"'{path}' is not an nn.Module class", "name the class of a block"
            )
        classes.append(obj)
    return tuple(classes)


def units_by_class(module: nn.Module, classes: tuple[type, ...]) -> list[nn.Module]:
    units = [m for m in module.modules() if m is not module and isinstance(m, classes)]
    if not units:
        names = ", ".join(c.__name__ for c in classes)
        held = sorted({type(m).__name__ for m in module.modules() if m is not module})
        raise ConfigError(
            "strategy.fsdp_wrap",
            f"{type(module).__name__} holds no module of class {names}",
            f"name classes it holds ({', '.join(held[:8])}), or drop strategy.fsdp_wrap to wrap by size",
        )
    # A unit inside another unit of a wrapped class is sharded first (post-order: modules() lists parents first).
    return units[::-1]


def units_by_size(module: nn.Module, min_params: int) -> list[nn.Module]:
    """Bottom-up: a module whose parameters not yet in a unit below it reach ``min_params`` becomes a unit."""
    units: list[nn.Module] = []

    def left_over(m: nn.Module) -> int:
        count = sum(p.numel() for p in m.parameters(recurse=False)) + sum(left_over(c) for c in m.children())
        if m is not module and not isinstance(m, CONTAINERS) and count >= min_params:
            units.append(m)
            return 0
        return count

    left_over(module)
    return units


def roots(module: nn.Module) -> list[nn.Module]:
    """The outermost modules that run a forward of their own: the top-level children, containers looked into."""
    found: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, CONTAINERS):
                visit(child)
            elif any(True for _ in child.parameters()):
                found.append(child)

    visit(module)
    return found


def refuse_own_parameters(module: nn.Module) -> None:
    own = [name for name, _ in module.named_parameters(recurse=False)]
    own += [f"{name}.{p}" for name, c in module.named_children() if isinstance(c, CONTAINERS)
            for p, _ in c.named_parameters(recurse=False)]  # fmt: skip
    if own:
        raise ConfigError(
            "strategy",
            f"strategy=fsdp shards the modules of {type(module).__name__}, and {', '.join(own[:4])} "
            "belong(s) to no submodule whose forward could gather it",
            "hold such parameters in a submodule (an nn.Module attribute used through its forward), or use "
            "strategy=ddp or strategy=deepspeed",
        )


def apply_fsdp_to_module(module: nn.Module, mesh: object, fsdp: FSDPConfig, precision: PrecisionConfig) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from disttrain.strategies.fsdp import hybrid_mesh, mixed_precision_policy

    refuse_own_parameters(module)
    dp_mesh = mesh["data_parallel"]  # type: ignore[index]
    if fsdp.dp_replicate > 1:
        dp_mesh = hybrid_mesh(dp_mesh, fsdp.dp_replicate)
    options: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mixed_precision_policy(fsdp, precision)}
    if fsdp.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    classes = wrap_classes(fsdp)
    units = units_by_class(module, classes) if classes else units_by_size(module, fsdp.fsdp_unit_min_params)
    unit_ids = {id(u) for u in units}
    for unit in units:
        fully_shard(unit, reshard_after_forward=fsdp.reshard_after_forward, **options)
    for root in roots(module):
        if id(root) not in unit_ids:
            # Needed again right after backward reaches it: resharding after forward would add an all-gather.
            fully_shard(root, reshard_after_forward=False, **options)


def user_module_fsdp_plan(fsdp: FSDPConfig, precision: PrecisionConfig) -> Callable[[Any, object], None]:
    return partial(apply_fsdp_to_module, fsdp=fsdp, precision=precision)
