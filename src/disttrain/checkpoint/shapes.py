"""Refuse to resume from a checkpoint of a differently shaped model, before any rank starts.

Lightning would find out only inside ``trainer.fit``, on every rank, with a size-mismatch traceback. Here the
checkpoint's tensor shapes are read without loading the weights (a memory-mapped ``weights_only`` load of a
file checkpoint; the index of a torch.distributed.checkpoint directory) and compared with the configured
model built on the meta device.
"""

from __future__ import annotations

from pathlib import Path

import torch

from disttrain.config.errors import ConfigError
from disttrain.config.schema import AnyModelConfig, CustomModelConfig, LightningModuleConfig
from disttrain.models.factory import build_model_factory
from disttrain.models.transformer import canonical_name
from disttrain.models.user_module import build_lightning_module, resolve_model_kind


def checkpoint_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]] | None:
    """Model tensor shapes by name (``model.<param>``) from a checkpoint; None for a layout not known here."""
    try:
        if checkpoint.is_dir():
            if not (checkpoint / ".metadata").exists():
                return None  # not torch.distributed.checkpoint (e.g. DeepSpeed's own layout)
            from torch.distributed.checkpoint import FileSystemReader

            index = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
            prefix = "state_dict."
            return {
                canonical_name(k[len(prefix) :]): tuple(m.size)
                for k, m in index.items()
                if k.startswith(prefix) and hasattr(m, "size")
            }
        state = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # any unreadable checkpoint is the user's input problem, named as such
        raise ConfigError(
            "resume",
            f"cannot read the checkpoint '{checkpoint}' ({type(err).__name__}: {str(err).splitlines()[0]})",
            "point resume at a run dir whose checkpoints were written by disttrain",
        ) from None
    weights = state.get("state_dict", {}) if isinstance(state, dict) else {}
    return {canonical_name(k): tuple(v.shape) for k, v in weights.items() if isinstance(v, torch.Tensor)}


def model_shapes(model: AnyModelConfig, seed: int) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the configured model, named as the LightningModule's state dict names them (a user's
    LightningModule is that module itself; the built-in module holds the model as ``model``)."""
    if isinstance(model, CustomModelConfig | LightningModuleConfig):
        model = resolve_model_kind(model)
    if isinstance(model, LightningModuleConfig):
        module = build_lightning_module(model, device="meta")
        return {canonical_name(name): tuple(p.shape) for name, p in module.named_parameters()}
    meta = build_model_factory(model, seed)(device="meta")
    return {canonical_name(f"model.{name}"): tuple(p.shape) for name, p in meta.named_parameters()}


def check_checkpoint_fits_model(checkpoint: Path, model: AnyModelConfig, seed: int) -> None:
    saved = checkpoint_shapes(checkpoint)
    if saved is None:
        return
    expected = model_shapes(model, seed)
    fix = "resume with the model settings the run was started with (drop the model.* overrides), or start a new run"
    for name, shape in expected.items():
        if name in saved and saved[name] != shape:
            raise ConfigError(
                "model",
                f"the checkpoint '{checkpoint.name}' was saved from a differently shaped model: {name} is "
                f"{list(saved[name])} there but {list(shape)} in this config",
                fix,
            )
    missing = sorted(set(expected) - set(saved))
    if missing:
        raise ConfigError(
            "model",
            f"the checkpoint '{checkpoint.name}' lacks {len(missing)} of this model's {len(expected)} parameters "
            f"(e.g. {missing[0]})",
            fix,
        )
