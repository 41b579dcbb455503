"""A user's own LightningModule (``model._target_``): told apart from a token model, built by Hydra, and counted.

Preflight must not import torch (launch/fork.py), so the config cannot know what a ``_target_`` names until the job
starts: ``resolve_model_kind`` imports it there and returns the config of what it is. A LightningModule class, or a
function returning one, is trained as written; an ``nn.Module`` mapping token ids to logits is trained by the
language-model module (``models/module.py``) and needs ``model.vocab_size`` and ``model.seq_len``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from disttrain.config.errors import ConfigError
from disttrain.config.schema import CustomModelConfig, LightningModuleConfig
from disttrain.models.facts import ModelFacts
from disttrain.models.targets import resolve_target

TOKEN_FIX = (
    "add +model.vocab_size=<V> +model.seq_len=<T> for a model mapping token ids to logits, or name your LightningModule"
)


def nested_targets(values: Mapping[str, Any], key: str) -> Iterator[tuple[str, str]]:
    """Every ``_target_`` below ``values`` with its dotted key (``model.net._target_``), outermost first."""
    if "_target_" in values:
        yield f"{key}._target_", str(values["_target_"])
    for name, value in values.items():
        if isinstance(value, Mapping):
            yield from nested_targets(value, f"{key}.{name}")
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, Mapping):
                    yield from nested_targets(item, f"{key}.{name}[{index}]")


def is_lightning_module_class(obj: object) -> bool:
    return inspect.isclass(obj) and issubclass(obj, pl.LightningModule)


def resolve_model_kind(
    model: CustomModelConfig | LightningModuleConfig,
) -> CustomModelConfig | LightningModuleConfig:
    """What the ``_target_`` names, imported: a LightningModule class makes a LightningModuleConfig (a token model's
    ``vocab_size`` and ``seq_len``, if given, become its arguments); a plain ``nn.Module`` class needs both keys. A
    function is taken at its word: without those keys it must return a LightningModule (checked when it is built)."""
    target = resolve_target(model.target, "model._target_")
    if not callable(target):
        raise ConfigError(
            "model._target_", f"'{model.target}' is a {type(target).__name__}", "name a LightningModule class"
        )
    if is_lightning_module_class(target):
        if isinstance(model, LightningModuleConfig):
            return model
        tokens = {"vocab_size": model.vocab_size, "seq_len": model.seq_len}
        return LightningModuleConfig(model.target, model.name, model.compile, {**tokens, **model.kwargs})
    if isinstance(model, LightningModuleConfig) and inspect.isclass(target):
        what = "an nn.Module" if issubclass(target, nn.Module) else f"a {target.__name__}"
        raise ConfigError(
            "model.vocab_size",
            f"is required: model._target_={model.target} is {what}, not a LightningModule, so it is trained as a "
            "token model (ids [batch, seq] to logits [batch, seq, vocab])",
            TOKEN_FIX,
        )
    return model


def hydra_node(model: LightningModuleConfig) -> dict[str, Any]:
    return {"_target_": model.target, **model.kwargs}


# Each local rank builds the whole module on the host before the strategy shards it (models/user_module.py).
OUT_OF_MEMORY_FIX = (
    "the module does not fit this host's memory as built: each local rank builds all of it before the strategy "
    "shards it; use a host with more memory or fewer local ranks (hw.devices_per_node), and see its memory per "
    "layout with python -m plan (the same ~model/~data overrides)"
)


def out_of_memory(error: BaseException | None) -> bool:
    """An allocation that failed (host or device), however the allocator said so."""
    if isinstance(error, MemoryError | torch.OutOfMemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def build_lightning_module(model: LightningModuleConfig, device: str | None = None) -> pl.LightningModule:
    """The user's module as Hydra builds it (nested ``_target_`` nodes and ``_partial_`` included), on ``device``
    (``meta``: shapes and counts only). Import and call errors are one line naming the key."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    node = hydra_node(model)
    for key, target in nested_targets(node, "model"):
        resolve_target(target, key)  # one line naming the nested key, where Hydra would log three
    try:
        with torch.device(device) if device is not None else nullcontext():
            module = instantiate(node)
    except InstantiationException as err:
        cause = err.__cause__
        first = str(err).splitlines()[0].rstrip(":")
        said = f"{first}: {type(cause).__name__}: {cause}" if cause is not None else first
        fix = OUT_OF_MEMORY_FIX if out_of_memory(cause) else "give model the keys its signature takes"
        raise ConfigError("model._target_", said, fix) from None
    if not isinstance(module, pl.LightningModule):
        raise ConfigError(
            "model._target_",
            f"{model.target}(...) returned {type(module).__name__}, not a LightningModule",
            TOKEN_FIX,
        )
    return module


def stated_number(module: object, name: str) -> float | None:
    """A figure the module states itself (an attribute, or a method taking no argument), else None."""
    value = getattr(module, name, None)
    if callable(value):
        value = value()
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else None


def lightning_module_facts(model: LightningModuleConfig) -> ModelFacts:
    """Parameters counted on the meta device (nothing allocated); FLOPs the module states (``flops_per_sample``),
    else counted at the run's first step (training/flop_count.py); tokens only where it says what a token is
    (``tokens_per_sample``). A module that cannot be built on meta is built on the host for the count."""
    try:
        module = build_lightning_module(model, device="meta")
    except ConfigError:
        raise
    except Exception:  # data-dependent construction, ops without a meta kernel
        module = build_lightning_module(model)
    tokens = stated_number(module, "tokens_per_sample")
    count = sum(p.numel() for p in module.parameters())
    return ModelFacts(
        count,
        flops_per_token=None,
        tokens_per_sample=int(tokens) if tokens else None,
        stated_flops_per_sample=stated_number(module, "flops_per_sample"),
        automatic_optimization=bool(module.automatic_optimization),
    )


def check_manual_optimization(facts: ModelFacts, accumulation: int, grad_clip: float) -> str | None:
    """A module that optimizes manually runs one micro-batch a step (Lightning accumulates only for automatic
    optimization): refused with accumulation. Returns the line saying that ``trainer.grad_clip`` is the module's to
    apply (``self.clip_gradients``), or None."""
    if facts.automatic_optimization:
        return None
    if accumulation > 1:
        raise ConfigError(
            "trainer.global_batch_size",
            f"your LightningModule optimizes manually (automatic_optimization=False), and {accumulation} micro-batches "
            "a step need Lightning's gradient accumulation, which only automatic optimization has",
            "drop trainer.global_batch_size (one micro-batch per rank a step), or accumulate in your training_step",
        )
    if not grad_clip:
        return None
    return (
        f"note: trainer.grad_clip={grad_clip:g} is not applied: your LightningModule optimizes manually (clip in "
        "training_step with self.clip_gradients)"
    )


def build_user_module(model: LightningModuleConfig, plan: Callable[[Any, object], None] | None) -> pl.LightningModule:
    """The user's module for training, with the strategy's ``plan`` (FSDP2 units, ZeRO-3 partitioning) applied in
    its ``configure_model`` after the user's own: there the strategy has set up its mesh and process groups, and the
    optimizer, built next, sees the sharded parameters. ``model.compile``: its top-level submodules compiled first."""
    module = build_lightning_module(model)
    if model.compile:
        plan = with_compile_first(plan)
    if plan is not None:
        apply_in_configure_model(module, plan)
    return module


def compile_submodules(module: nn.Module) -> list[str]:
    """``torch.compile`` the ``forward`` of each top-level submodule that holds parameters (``compile_roots``), in
    place; the names compiled.

    The forward, not the module: the module's hooks stay outside the graph, where FSDP2 gathers and reduce-scatters
    and DeepSpeed's ZeRO-3 fetches (an in-place ``nn.Module.compile`` traces them, and captures nothing at all for a
    torch.nn container such as a Sequential), and the parameters keep their names, so checkpoints, the export and
    the user's own ``load_state_dict`` see the module as written. Submodules, not the
    LightningModule: its ``training_step`` and ``self.log`` are Python the graph would break on."""
    names = {id(m): name for name, m in module.named_modules()}
    compiled = []
    for sub in compile_roots(module):
        sub.forward = torch.compile(sub.forward)  # type: ignore[method-assign]
        compiled.append(names[id(sub)])
    return compiled


def compile_roots(module: nn.Module) -> list[nn.Module]:
    """The top-level children holding parameters, ModuleLists and ModuleDicts looked into (they have no forward).
    A Sequential is compiled whole, unlike FSDP's roots: where code indexes it instead of calling it, its members
    simply run eager, which costs speed, not correctness."""
    found: list[nn.Module] = []
    for child in module.children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            found += compile_roots(child)
        elif any(True for _ in child.parameters()):
            found.append(child)
    return found


def with_compile_first(plan: Callable[[Any, object], None] | None) -> Callable[[Any, object], None]:
    """``plan`` preceded by ``compile_submodules``: compiled before the strategy shards."""

    def compiled_then_planned(module: Any, mesh: object) -> None:
        compile_submodules(module)
        if plan is not None:
            plan(module, mesh)

    return compiled_then_planned


def apply_in_configure_model(module: pl.LightningModule, plan: Callable[[Any, object], None]) -> None:
    """Wrap the instance's ``configure_model``: the user's hook first (Lightning's default is empty), then ``plan``
    once (Lightning may call the hook again, for a validation after fit), unless the user's hook applied FSDP2
    itself. Set on the instance, so the user's class stays theirs (checkpoints, ``load_from_checkpoint``)."""
    from torch.distributed.fsdp import FSDPModule

    own = module.configure_model
    applied = False

    def configure_model() -> None:
        nonlocal applied
        own()
        if applied:
            return
        applied = True
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            return  # the user's configure_model sharded the module as they want it
        plan(module, getattr(module, "_device_mesh", None))

    module.configure_model = configure_model  # type: ignore[method-assign]
