"""The run's own layers for the start-up parts probe (``diagnostics.collect.parts.time_model_parts``): one
transformer block, the model without blocks (embedding, final norm, LM head; the probe adds the loss) and the
run's optimizer over a block's parameters, in the run's precision on the run's device.

An HF model's decoder layers take family-specific arguments (RoPE tables, masks, caches) only the model itself
passes them, so its probe is the model's own config at two layers: the probe times each layer inside the whole
model's forward and backward, and the rest of the pass is the edges (``hf_model_parts``).

The planner composes every layout's step from these measured parts (``disttrain.planner.measured``): a block is
the unit FSDP shards, TP splits and PP stages hold, so one block's time stands for all of them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import TypeGuard

import torch
from torch import nn

from disttrain.config.hf import hf_shape, load_hf_config
from disttrain.config.schema import CUDAGRAPH_MODES, HFModelConfig, ModelConfig, OptimizerConfig
from disttrain.models.factory import Fp8Linears
from disttrain.models.fp8 import apply_fp8
from disttrain.models.hf import HFCausalLM
from disttrain.models.module import compiled_next_token_loss, next_token_loss, param_groups, use_fused_adamw
from disttrain.models.transformer import Block, Transformer, build_model, rope_cache

# Lightning precision name -> (dtype the parameters are held in, dtype autocast runs the matmuls in or None).
PRECISIONS: dict[str, tuple[torch.dtype, torch.dtype | None]] = {
    "fp32": (torch.float32, None),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "bf16-true": (torch.bfloat16, None),
    "fp16-mixed": (torch.float32, torch.float16),
    "fp8": (torch.float32, torch.bfloat16),  # planned as bf16-mixed (the planner says so too)
}


def model_parts(
    cfg: ModelConfig,
    optimizer: OptimizerConfig,
    precision: str,
    device: torch.device,
    fp8: Fp8Linears | None = None,
) -> dict[str, object]:
    """``block``, ``edges`` (modules), ``rope`` (cos, sin or None), ``autocast`` (a context factory), ``optimizer``
    (the run's AdamW over the block's parameters) and the shape facts the calibration record keeps to say which
    model it measured. ``fp8``: the block's linear layers train in fp8 as the run's do (their time and the fp8
    inputs they keep for backward), and the edges' LM head where the run's does."""
    param_dtype, autocast_dtype = PRECISIONS.get(precision, (torch.float32, None))
    torch.manual_seed(0)
    block = Block(cfg, 0).to(device=device, dtype=param_dtype)
    if fp8 is not None:
        apply_fp8(block, fp8.recipe, fsdp_all_gather=False)
    edges = Transformer(dataclasses.replace(cfg, n_layers=1)).to(device=device, dtype=param_dtype)
    edges.blocks = nn.ModuleList()  # embedding, final norm, head: the model's parts outside its blocks
    if fp8 is not None and fp8.head:
        apply_fp8(edges, fp8.recipe, fsdp_all_gather=False, head=True)
    rope = rope_cache(cfg.seq_len, cfg.head_dim, cfg.rope_theta, device=device) if cfg.pos_emb == "rope" else None

    factory: Callable[[], torch.optim.Optimizer] = functools.partial(block_optimizer, block, optimizer)
    compiled = probe_compiles(cfg, device)
    # CUDA graphs replay inductor's kernels: the probe compiles them without graphs (a probe's graphs would hold a
    # private memory pool through the run) and times them on the GPU's clock, the launches hidden as in a replay.
    gpu_clock = compiled and cfg.compile_mode in CUDAGRAPH_MODES
    mode = WITHOUT_GRAPHS.get(cfg.compile_mode or "", cfg.compile_mode)
    timed: nn.Module = torch.compile(block, mode=mode) if compiled else block
    return {
        "block": timed,
        # What the run's loss is: compiled with its blocks (models/module.py), else eager.
        "loss": compiled_next_token_loss() if cfg.compile else next_token_loss,
        # Compiling takes the first pass; the run's blocks reuse the compiled code (same class, shapes, dtypes).
        "warmup": 2 if compiled else 1,
        "compiled": (cfg.compile_mode or "default") if compiled else None,
        "gpu_clock": gpu_clock,
        "edges": edges,
        "rope": rope,
        "autocast": _autocast(device, autocast_dtype),
        "optimizer": factory,
        "param_dtype": param_dtype,
        "d_model": cfg.d_model,
        "vocab_size": cfg.vocab_size,
        "seq_len": cfg.seq_len,
        "block_numel": sum(p.numel() for p in block.parameters()),
    }


# The torch.compile mode that builds a CUDA-graph mode's kernels without recording graphs.
WITHOUT_GRAPHS = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}


def dense_known_model(model: object) -> TypeGuard[ModelConfig | HFModelConfig]:
    """Whether a probe can build a copy of ``model``: the reference transformer or an HF model, without experts
    (a user's own model's layers are unknown; experts are routed and placed, which a copy would not reproduce)."""
    if type(model) is ModelConfig:
        return model.num_experts == 0
    if isinstance(model, HFModelConfig):
        return hf_shape(model).num_experts == 0
    return False


def small_model_copy(model: ModelConfig | HFModelConfig, param_dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The run's model cut down for a probe (tokens -> logits): the reference transformer at one block with its edges,
    an HF model at ``PROBE_LAYERS`` layers; built under a private RNG (the run's random streams are not the probe's
    to move)."""
    if isinstance(model, HFModelConfig):
        return hf_probe_model(model, param_dtype, device)  # forks the RNG itself
    with torch.random.fork_rng(devices=[]):
        return build_model(dataclasses.replace(model, n_layers=1), seed=0, device=device).to(dtype=param_dtype)


def probe_compiles(cfg: ModelConfig, device: torch.device) -> bool:
    """Whether the probe times its block compiled as the run's are: when the run compiles its blocks (into CUDA
    graphs only on a GPU: on a CPU, where graphs are refused before launch, the block stays eager)."""
    return bool(cfg.compile) and (cfg.compile_mode not in CUDAGRAPH_MODES or device.type == "cuda")


# The HF probe's copy of the model: two layers, so each layer is timed between two others' work, as in the run.
PROBE_LAYERS = 2


def hf_model_parts(
    cfg: HFModelConfig,
    optimizer: OptimizerConfig,
    precision: str,
    device: torch.device,
    fp8: Fp8Linears | None = None,
) -> dict[str, object]:
    """``model`` (the run's HF model at ``PROBE_LAYERS`` decoder layers, tokens -> logits), ``layers`` (its decoder
    layers, each timed inside the model's passes), ``autocast``, ``optimizer`` (the run's AdamW over one layer) and
    the shape facts, as ``model_parts`` has them."""
    param_dtype, autocast_dtype = PRECISIONS.get(precision, (torch.float32, None))
    shape = hf_shape(cfg)
    model = hf_probe_model(cfg, param_dtype, device)
    if fp8 is not None:
        apply_fp8(model, fp8.recipe, fsdp_all_gather=False, head=fp8.head)
    block = model.blocks[0]
    factory: Callable[[], torch.optim.Optimizer] = functools.partial(block_optimizer, block, optimizer)
    return {
        "model": model,
        "layers": model.blocks,
        "autocast": _autocast(device, autocast_dtype),
        "optimizer": factory,
        "param_dtype": param_dtype,
        "d_model": shape.d_model,
        "vocab_size": shape.vocab_size,
        "seq_len": cfg.seq_len,
        "block_numel": sum(p.numel() for p in block.parameters()),
    }


def hf_probe_model(cfg: HFModelConfig, param_dtype: torch.dtype, device: torch.device) -> HFCausalLM:
    """The run's HF model at ``PROBE_LAYERS`` decoder layers with HF's own init (the probe's weights do not matter;
    built under a private RNG, since the run's random streams do)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(load_hf_config(cfg))  # the cached config is the run's: never changed in place
    config.num_hidden_layers = min(PROBE_LAYERS, hf_shape(cfg).n_layers)  # GPT-2's n_layer maps onto it
    with torch.random.fork_rng(devices=[]):
        hf = AutoModelForCausalLM.from_config(config, attn_implementation=cfg.attn_implementation, dtype=param_dtype)
    return HFCausalLM(hf).to(device)


def _autocast(device: torch.device, dtype: torch.dtype | None) -> Callable[[], contextlib.AbstractContextManager]:
    def autocast() -> contextlib.AbstractContextManager:
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype)

    return autocast


def block_optimizer(block: nn.Module, optimizer: OptimizerConfig) -> torch.optim.Optimizer:
    """The run's AdamW (its settings, fused where the run's would be) over one block's parameters."""
    groups = param_groups(block, optimizer.weight_decay)
    fused = use_fused_adamw([p for g in groups for p in g["params"]], optimizer.fused)
    betas = (optimizer.beta1, optimizer.beta2)
    return torch.optim.AdamW(groups, lr=optimizer.lr, betas=betas, eps=optimizer.eps, fused=fused or None)
