"""``model=hf``: a ``transformers`` causal LM behind the interface the strategies use (token ids -> logits).

``HFCausalLM`` wraps the ``PreTrainedModel`` so the LightningModule, FSDP2 and DeepSpeed see what they see for
the reference transformer: ``forward(tokens) -> logits``, ``blocks`` (the decoder layers, found by the model's own
``_no_split_modules``: FSDP2 shards one at a time) and in-place activation checkpointing of those blocks.

Built from a config, the weights get the project's deterministic init: every tensor drawn from a generator seeded
by (seed, parameter name), so every rank and a single-process reference hold bitwise the same values.
From ``model.path`` the weights are the directory's safetensors, loaded without any hub access.

Where a rank's starting weights come from is the strategy's choice (``placement``): ``whole`` builds or loads the
whole model on every rank; ``rank0`` does so on rank 0 only and gives the other ranks the structure with
unset values (DDP broadcasts rank 0's parameters when it wraps the model); ``deferred`` leaves the parameters on
the meta device (buffers, such as RoPE tables, are real) for the strategy to materialize already sharded: FSDP2
after ``fully_shard`` (``strategies/fsdp.py``), ZeRO-3 one module at a time (``materialize_by_module``). The
values are then read tensor by tensor (``initial_value``): drawn from the seeded generators, or read from the
safetensors file by rank 0 alone.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from disttrain.config.hf import hf_shape, legacy_expert_sources, legacy_name, load_hf_config
from disttrain.config.schema import HFModelConfig
from disttrain.models.hf_moe import FUSED_WEIGHTS, HFExperts, adopt_hf_experts
from disttrain.models.transformer import _param_seed

# What HF's own checkpoint_wrapper-free code path would add to names; stripped so init seeds ignore wrappers.
_WRAPPED = "_checkpoint_wrapped_module."
PLACEMENTS = ("whole", "rank0", "deferred")
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"


class SafetensorsWeights:
    """The tensors of a ``save_pretrained`` directory (one ``model.safetensors`` or shards listed in its index),
    read one at a time: each read maps its file only while it copies the tensor out, so the reader never keeps
    more than that tensor (``from_pretrained`` keeps the whole mapping, one page-cache copy per node)."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory).expanduser()
        index = directory / SAFETENSORS_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: directory / file for name, file in weight_map.items()}
        else:
            from safetensors import safe_open

            single = directory / SAFETENSORS_FILE
            with safe_open(str(single), framework="pt") as handle:
                self.files = {name: single for name in handle.keys()}  # noqa: SIM118 (not a dict)

    def holds(self, name: str) -> bool:
        return legacy_name(name, self.files) is not None or legacy_expert_sources(name, self.files) is not None

    def get(self, name: str, rows: list[int] | None = None) -> torch.Tensor:
        """The tensor ``name`` (only ``rows`` of dim 0, in that order, when given); a fused expert weight the file
        stores per expert (``config.hf.legacy_expert_sources``) is assembled from the experts in ``rows`` alone."""
        from safetensors import safe_open

        held = legacy_name(name, self.files)
        if held is not None:
            with safe_open(str(self.files[held]), framework="pt") as handle:
                if rows is None:
                    return handle.get_tensor(held)
                stored = handle.get_slice(held)
                return torch.cat([stored[row : row + 1] for row in rows])
        sources = legacy_expert_sources(name, self.files) or []
        chosen = sources if rows is None else [sources[row] for row in rows]
        return torch.stack([torch.cat([self.get(part) for part in parts]) for parts in chosen])


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
    def __init__(self, hf: nn.Module, seed: int = 0, init_std: float = 0.02, path: str | None = None) -> None:
        super().__init__()
        adopt_hf_experts(hf)  # fused MoE expert banks as the project's expert layers (models/hf_moe.py)
        self.hf = hf
        # Where deferred parameters get their values (see the module docstring).
        self.seed, self.init_std, self.path = seed, init_std, path
        if path is not None:
            # A model read from model.path has no model.config to override: no balancing-weight lever to offer.
            for module in hf.modules():
                if isinstance(module, HFExperts):
                    module.balance_key = None
        self._weights: SafetensorsWeights | None = None

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

    def parameter_aliases(self) -> list[tuple[list[str], nn.Parameter]]:
        """Each parameter of the HF model once, with every name it has (a tied LM head has two), the one
        ``named_parameters`` lists first, wrapper segments removed."""
        found: dict[int, tuple[list[str], nn.Parameter]] = {}
        for name, param in self.hf.named_parameters(remove_duplicate=False):
            found.setdefault(id(param), ([], param))[0].append(name.replace(_WRAPPED, ""))
        return list(found.values())

    def expert_rows(self) -> dict[str, tuple[list[int], int]]:
        """Names of expert weights this rank holds only some experts of (``strategy.ep``) -> (the global ids of the
        rows it holds, the experts of the whole tensor): their starting values are those rows of the whole tensor's."""
        rows = {}
        for module_name, module in self.hf.named_modules():
            if isinstance(module, HFExperts) and module.ep_size > 1:
                keep = module.held_ids
                for weight in FUSED_WEIGHTS:
                    rows[f"{module_name}.{weight}".replace(_WRAPPED, "")] = (keep, module.num_experts)
        return rows

    def _whole(self, name: str, shape: torch.Size) -> tuple[torch.Size, list[int] | None]:
        if not name.endswith(tuple(f".experts.{weight}" for weight in FUSED_WEIGHTS)):
            return shape, None  # not an expert weight: no walk over the modules for it (called per parameter)
        held = self.expert_rows().get(name)
        if held is None or shape[0] == held[1]:
            return shape, None
        return torch.Size((held[1], *shape[1:])), held[0]

    def init_value(self, name: str, shape: torch.Size) -> torch.Tensor:
        """The deterministic init of one tensor: matrices ~ N(0, std), biases 0, other vectors (norm weights) 1,
        each from its own generator seeded by (seed, name); of this rank's experts, their rows of the whole."""
        whole, rows = self._whole(name, shape)
        if rows is not None:
            return self.init_value(name, whole)[rows]
        if name.endswith("bias"):
            return torch.zeros(shape)
        if len(shape) == 1:
            return torch.ones(shape)
        gen = torch.Generator().manual_seed(_param_seed(self.seed, name))
        return torch.empty(shape).normal_(0.0, self.init_std, generator=gen)

    def initial_value(self, names: list[str], shape: torch.Size) -> torch.Tensor:
        """A parameter's starting value (fp32, full size): read from ``model.path`` under the first of its names the
        file has, else drawn by the deterministic init under its first name."""
        if self.path is None:
            return self.init_value(names[0], shape)
        if self._weights is None:
            self._weights = SafetensorsWeights(self.path)
        stored = next((n for n in names if self._weights.holds(n)), None)
        if stored is None:
            raise KeyError(f"{self.path} holds no tensor for {names[0]}")
        _, rows = self._whole(names[0], shape)
        value = self._weights.get(stored, rows)
        if value.shape != shape:
            raise ValueError(f"{self.path}: {stored} has shape {tuple(value.shape)}, the model {tuple(shape)}")
        return value.float()

    @torch.no_grad()
    def init_weights(self, seed: int, std: float) -> None:
        """Every parameter set to its deterministic init (``init_value``) for ``seed`` and ``std``."""
        self.seed, self.init_std = seed, std
        for name, param in self.hf.named_parameters():  # a tied LM head is the embedding: listed once
            param.copy_(self.init_value(name.replace(_WRAPPED, ""), param.shape).to(param.dtype))

    @property
    def expert_parallel(self) -> bool:
        """Whether ranks hold different experts (their starting values differ, so none can be broadcast)."""
        return bool(self.expert_rows())

    @property
    def deferred(self) -> bool:
        """Whether the parameters still wait on the meta device for their values."""
        return any(p.is_meta for p in self.parameters())

    @torch.no_grad()
    def materialize_by_module(self, fill: bool, partition: Callable[[list[nn.Parameter]], None] | None) -> int:
        """Give the deferred parameters real storage one module at a time, each then handed to ``partition`` (ZeRO-3
        keeps this rank's slice and frees the rest) before the next is allocated. With ``fill`` this rank writes the
        starting values (``initial_value``); else the storage is left unset for ``partition`` to overwrite.

        Returns the largest number of elements held unpartitioned at once (one module's parameters)."""
        names = {id(param): aliases for aliases, param in self.parameter_aliases()}
        deferred: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}
        for module in self.hf.modules():  # every place a parameter sits: a tied one sits in two
            for attr, param in module._parameters.items():
                if param is not None and param.is_meta:
                    deferred.setdefault(id(param), (param, []))[1].append((module, attr))
        peak = 0
        for module in self.hf.modules():
            fresh = []
            for param in [p for p in module._parameters.values() if p is not None and p.is_meta]:
                # The value becomes the storage itself (no second full-size copy of the module).
                data = self.initial_value(names[id(param)], param.shape) if fill else torch.empty(param.shape)
                real = nn.Parameter(data.to(param.dtype), requires_grad=param.requires_grad)
                for owner, attr in deferred[id(param)][1]:
                    owner._parameters[attr] = real
                fresh.append(real)
            peak = max(peak, sum(p.numel() for p in fresh))
            if fresh and partition is not None:
                partition(fresh)
        return peak

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write the model in HF format (config.json + model.safetensors), loadable with ``from_pretrained``."""
        self.hf.save_pretrained(str(directory), state_dict=state_dict)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules constructed inside register their parameters on the meta device, their buffers where they are made.

    ``torch.device("meta")`` would put the buffers there too, and the non-persistent ones (RoPE tables) are in no
    checkpoint: they could not be restored. Each parameter is moved as it is registered, before the module's own
    init runs on it (a no-op on meta), so no rank allocates the model's weights while building it."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def build_hf_model(
    model: HFModelConfig, seed: int, device: str | torch.device = "cpu", placement: str = "whole"
) -> HFCausalLM:
    """The HF model on ``device``: loaded from ``model.path``, or built from the config with the deterministic
    init; on ``"meta"`` only its structure (for parameter counts and shape checks). ``placement``: see the module
    docstring."""
    from transformers import AutoModelForCausalLM

    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    # A copy: transformers keeps (and sets attributes on) the config it is given, and load_hf_config's is cached.
    config = copy.deepcopy(load_hf_config(model))
    kind = model.attn_implementation
    std = hf_shape(model).init_std
    path = None if model.path is None else str(Path(model.path).expanduser())
    if torch.device(device).type == "meta":
        with torch.device("meta"):
            return HFCausalLM(AutoModelForCausalLM.from_config(config, attn_implementation=kind), seed, std, path)
    if placement == "deferred" or (placement == "rank0" and _rank() != 0):
        # The structure with real buffers; under fork_rng as HF's constructors may draw (on meta: nothing).
        with torch.random.fork_rng(devices=[]), parameters_on_meta():
            hf = AutoModelForCausalLM.from_config(config, attn_implementation=kind, dtype=torch.float32)
        wrapped = HFCausalLM(hf, seed, std, path)
        if placement == "rank0":  # DDP overwrites these with rank 0's values when it wraps the model
            wrapped.materialize_by_module(fill=False, partition=None)
            return wrapped.to(device)
        return wrapped
    if path is not None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its "Loading weights" bar is not a line of the run's console
        hf = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32, attn_implementation=kind
        )
        return HFCausalLM(hf.to(device), seed, std, path)
    # Built on the CPU for its buffers (RoPE tables) under a private RNG, then every weight is overwritten.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(config, attn_implementation=kind, dtype=torch.float32)
    wrapped = HFCausalLM(hf, seed, std, path)
    wrapped.init_weights(seed, std)
    return wrapped.to(device)
