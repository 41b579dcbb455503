"""``model=hf``: a ``transformers`` causal LM behind the interface the strategies use (token ids -> logits).

``HFCausalLM`` wraps the ``PreTrainedModel`` so the LightningModule, FSDP2 and DeepSpeed see what they see for
the reference transformer: ``forward(tokens) -> logits``, ``blocks`` (the decoder layers, found by the model's own
``_no_split_modules``: FSDP2 shards one at a time) and in-place activation checkpointing of those blocks.

Built from a config, the weights get the project's deterministic init: every tensor drawn from a generator seeded
by (seed, parameter name), so every rank and a single-process reference hold bitwise the same values.
From ``model.path`` the weights are the directory's safetensors, loaded without any hub access.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from disttrain.config.hf import hf_shape, load_hf_config
from disttrain.config.schema import HFModelConfig
from disttrain.models.transformer import _param_seed

# What HF's own checkpoint_wrapper-free code path would add to names; stripped so init seeds ignore wrappers.
_WRAPPED = "_checkpoint_wrapped_module."


SELECTIVE_PREFIX = "disttrain_recompute_"


def _recomputed_attention(inner: str) -> Callable:
    """An attention kernel that runs transformers' ``inner`` kernel and recomputes it in backward."""

    def attention(
        module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: object, **kwargs: object
    ) -> tuple[torch.Tensor, object]:
        from torch.utils.checkpoint import checkpoint
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        # "eager" is not registered: each modeling file has its own, which its attention passes as the default.
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        kernel = ALL_ATTENTION_FUNCTIONS.get_interface(inner, eager)
        if kernel is None:
            raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward to recompute")

        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, object]:
            return kernel(module, q, k, v, mask, **kwargs)

        return checkpoint(core, query, key, value, use_reentrant=False)

    return attention


class HFCausalLM(nn.Module):
    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    @property
    def block_classes(self) -> tuple[str, ...]:
        return tuple(getattr(self.hf, "_no_split_modules", None) or ())

    @property
    def blocks(self) -> list[nn.Module]:
        """The decoder layers (possibly wrapped for checkpointing), in order."""
        return [module for _, _, module in self._block_slots()]

    def _block_slots(self) -> list[tuple[nn.ModuleList, int, nn.Module]]:
        slots = []
        for container in self.hf.modules():
            if isinstance(container, nn.ModuleList):
                for index, child in enumerate(container):
                    inner = getattr(child, "_checkpoint_wrapped_module", child)
                    if type(inner).__name__ in self.block_classes:
                        slots.append((container, index, child))
        return slots

    def apply_activation_checkpointing(self) -> None:
        """Recompute each decoder layer in backward (non-reentrant), replacing it in place like the reference
        model's blocks so FSDP2 can still shard per layer; state_dict keys are unchanged."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            CheckpointWrapper,
            checkpoint_wrapper,
        )

        for container, index, child in self._block_slots():
            if not isinstance(child, CheckpointWrapper):
                container[index] = checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT)

    def apply_selective_recompute(self) -> None:
        """Megatron's selective recomputation: keep the projections' activations, recompute only the attention
        core (the kernel ``softmax(q k^T) v`` behind ``model.attn_implementation``) in backward.

        transformers looks the kernel up by the config's ``_attn_implementation`` name in ``AttentionInterface`` (and
        its causal mask's format in ``AttentionMaskInterface``): the model is switched to a registered name whose
        kernel is the original one under non-reentrant checkpointing and whose mask is the original one's."""
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        inner = self.hf.config._attn_implementation
        if inner.startswith(SELECTIVE_PREFIX):
            return
        name = SELECTIVE_PREFIX + inner
        AttentionInterface.register(name, _recomputed_attention(inner))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
        self.hf.config._attn_implementation = name

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits

    @torch.no_grad()
    def init_weights(self, seed: int, std: float) -> None:
        """Matrices ~ N(0, std), biases 0, other vectors (norm weights) 1, each from its own seeded generator."""
        for name, param in self.hf.named_parameters():  # a tied LM head is the embedding: listed once
            name = name.replace(_WRAPPED, "")
            if name.endswith("bias"):
                value = torch.zeros(param.shape)
            elif param.ndim == 1:
                value = torch.ones(param.shape)
            else:
                gen = torch.Generator().manual_seed(_param_seed(seed, name))
                value = torch.empty(param.shape).normal_(0.0, std, generator=gen)
            param.copy_(value.to(param.dtype))

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write the model in HF format (config.json + model.safetensors), loadable with ``from_pretrained``."""
        self.hf.save_pretrained(str(directory), state_dict=state_dict)


def build_hf_model(model: HFModelConfig, seed: int, device: str | torch.device = "cpu") -> HFCausalLM:
    """The HF model on ``device``: loaded from ``model.path``, or built from the config with the deterministic
    init; on ``"meta"`` only its structure (for parameter counts and shape checks)."""
    from transformers import AutoModelForCausalLM

    # A copy: transformers keeps (and sets attributes on) the config it is given, and load_hf_config's is cached.
    config = copy.deepcopy(load_hf_config(model))
    kind = model.attn_implementation
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return HFCausalLM(AutoModelForCausalLM.from_config(config, attn_implementation=kind))
    if model.path is not None:
        hf = AutoModelForCausalLM.from_pretrained(
            str(Path(model.path).expanduser()), local_files_only=True, dtype=torch.float32, attn_implementation=kind
        )
        return HFCausalLM(hf.to(device))
    # Built on the CPU for its buffers (RoPE tables) under a private RNG, then every weight is overwritten.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(config, attn_implementation=kind, dtype=torch.float32)
    wrapped = HFCausalLM(hf)
    wrapped.init_weights(seed, hf_shape(model).init_std)
    return wrapped.to(device)
