"""The model a run trains, as a factory (reference transformer or the user's ``model._target_``), and its facts.

The factory is called where the weights should live: on the meta device for shape checks and parameter counts,
inside ``LightningModule.configure_model`` for training.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from disttrain.config.errors import ConfigError
from disttrain.config.hf import hf_shape
from disttrain.config.schema import CustomModelConfig, HFModelConfig, LightningModuleConfig, ModelConfig
from disttrain.models.accounting import count_parameters, flops_per_token
from disttrain.models.facts import ModelFacts
from disttrain.models.fp8 import HEAD_NAMES, apply_fp8, is_float8, is_head
from disttrain.models.hf import build_hf_model
from disttrain.models.targets import resolve_target
from disttrain.models.transformer import build_model
from disttrain.models.user_module import lightning_module_facts


@dataclass(frozen=True)
class Fp8Linears:
    """precision=fp8: which torchao recipe the linear layers train with, and whether FSDP2 all-gathers in fp8."""

    recipe: str
    fsdp_all_gather: bool = False
    head: bool = False  # precision.fp8_head: the LM head in fp8 too


def build_model_factory(
    model: ModelConfig | CustomModelConfig | HFModelConfig,
    seed: int,
    placement: str = "whole",
    fp8: Fp8Linears | None = None,
) -> partial[nn.Module]:
    """``placement`` (``model=hf`` only, see models/hf.py): where the strategy wants the starting weights.
    ``fp8``: swap the linear layers for torchao's fp8 ones, before any compile or parallel plan sees them."""
    if isinstance(model, HFModelConfig):
        return partial(_build_hf_model, model, seed, placement=placement, fp8=fp8)
    if isinstance(model, CustomModelConfig):
        return partial(_build_custom_model, model, resolve_target(model.target, "model._target_"), fp8=fp8)
    return partial(_build_reference_model, model, seed, fp8=fp8)


def maybe_apply_fp8(module: nn.Module, fp8: Fp8Linears | None) -> None:
    if fp8 is None:
        return
    if apply_fp8(module, fp8.recipe, fp8.fsdp_all_gather, head=fp8.head) == 0:
        raise ConfigError(
            "precision",
            "fp8 found no linear layer to convert (plain nn.Linear, dimensions multiples of 16, not the LM head)",
            "use precision=bf16-mixed for this model",
        )
    if fp8.head and not any(is_head(name) and is_float8(m) for name, m in module.named_modules()):
        raise ConfigError(
            "precision.fp8_head",
            f"no output head ({', '.join(HEAD_NAMES)}: a plain nn.Linear, dimensions in multiples of 16) to convert",
            "use precision.fp8_head=false",
        )


def _build_reference_model(
    model: ModelConfig, seed: int, device: str = "cpu", fp8: Fp8Linears | None = None
) -> nn.Module:
    module = build_model(model, seed=seed, device=device)
    maybe_apply_fp8(module, fp8)
    if model.compile:
        # Per-block compilation (the torchtitan recipe) keeps FSDP's per-block hooks outside the graphs.
        for index, block in enumerate(module.blocks):
            module.blocks[index] = torch.compile(block, mode=model.compile_mode)
    return module


def _build_hf_model(
    model: HFModelConfig, seed: int, device: str = "cpu", placement: str = "whole", fp8: Fp8Linears | None = None
) -> nn.Module:
    module = build_hf_model(model, seed, device, placement)
    maybe_apply_fp8(module, fp8)
    return torch.compile(module) if model.compile and device != "meta" else module


def _build_custom_model(
    model: CustomModelConfig, factory: object, device: str = "cpu", fp8: Fp8Linears | None = None
) -> nn.Module:
    kwargs = {"vocab_size": model.vocab_size, "seq_len": model.seq_len, **model.kwargs}
    try:
        with torch.device(device):
            module = factory(**kwargs)  # type: ignore[operator]
    except TypeError as err:  # wrong or missing keyword arguments for the user's signature
        problem = f"calling {model.target}(...) failed: {err}"
        raise ConfigError("model._target_", problem, "give model the keys its signature takes") from None
    if not isinstance(module, nn.Module):
        raise ConfigError("model._target_", f"'{model.target}' returned {type(module).__name__}", "return an nn.Module")
    maybe_apply_fp8(module, fp8)
    return torch.compile(module) if model.compile else module


def check_logits_shape(meta: nn.Module, model: CustomModelConfig) -> None:
    """A user model must map token ids ``[batch, seq]`` to logits ``[batch, seq, vocab]`` (the loss reads them so):
    one forward on the meta device (no memory, no compute) finds a model that returns something else as the job
    starts (``model_facts``), where the loss would fail on every rank at its first step. A model meta cannot run
    (data-dependent code, ops without a meta kernel) is left to the run."""
    tokens = torch.zeros(2, model.seq_len, dtype=torch.long, device="meta")
    was_training = meta.training
    meta.eval()  # dropout and the like off; a model that counts its training calls does not count this one
    try:
        with torch.no_grad():
            out = meta(tokens)
    except Exception:  # the check only speaks when the model ran
        return
    finally:
        meta.train(was_training)
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
    # More columns than the vocabulary is a padded head (GPT-2's 50304): the loss reads them all, targets stay below.
    if shape is not None and len(shape) == 3 and shape[:2] == (2, model.seq_len) and shape[2] >= model.vocab_size:
        return
    raise ConfigError(
        "model._target_",
        f"{model.target}(tokens [2, {model.seq_len}]) returned {list(shape) if shape else type(out).__name__}, "
        f"not logits [2, {model.seq_len}, {model.vocab_size}] (batch, seq, model.vocab_size)",
        "return the logits tensor itself (not a dict, tuple or output object), one row per token and at least "
        "model.vocab_size columns",
    )


def model_facts(
    model: ModelConfig | CustomModelConfig | HFModelConfig | LightningModuleConfig, seed: int
) -> ModelFacts:
    """Parameter count and training FLOPs per token (per sample for a LightningModule), without allocating the
    weights."""
    if isinstance(model, LightningModuleConfig):
        return lightning_module_facts(model)
    if isinstance(model, ModelConfig):
        return ModelFacts(count_parameters(model), flops_per_token(model), model.seq_len)
    if isinstance(model, HFModelConfig):
        # The count is the real model's (on meta); FLOPs follow from the shape read from its config.
        count = sum(p.numel() for p in build_model_factory(model, seed)(device="meta").parameters())
        return ModelFacts(count, flops_per_token(hf_shape(model)), model.seq_len)
    meta = build_model_factory(model, seed)(device="meta")
    check_logits_shape(getattr(meta, "_orig_mod", meta), model)  # uncompiled: a check must not compile it
    count = sum(p.numel() for p in meta.parameters())
    custom = getattr(meta, "flops_per_token", None)
    # Without the model's own accounting only the 6N matmul term is known (attention FLOPs are not).
    return ModelFacts(count, float(custom(model.seq_len)) if callable(custom) else 6.0 * count, model.seq_len)
