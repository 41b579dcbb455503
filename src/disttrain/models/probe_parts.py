"""The run's own layers for the start-up parts probe (``diagnostics.collect.parts.time_model_parts``): one
transformer block, the model without blocks (embedding, final norm, LM head; the probe adds the loss) and the
run's optimizer over a block's parameters, in the run's precision on the run's device.

The planner composes every layout's step from these measured parts (``disttrain.planner.measured``): a block is
the unit FSDP shards, TP splits and PP stages hold, so one block's time stands for all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from disttrain.config.schema import ModelConfig, OptimizerConfig
from disttrain.models.module import param_groups, use_fused_adamw
from disttrain.models.transformer import Block, Transformer, rope_cache

# Lightning precision name -> (dtype the parameters are held in, dtype autocast runs the matmuls in or None).
PRECISIONS: dict[str, tuple[torch.dtype, torch.dtype | None]] = {
    "fp32": (torch.float32, None),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "bf16-true": (torch.bfloat16, None),
    "fp16-mixed": (torch.float32, torch.float16),
    "fp8": (torch.float32, torch.bfloat16),  # planned as bf16-mixed (the planner says so too)
}


def model_parts(
    cfg: ModelConfig, optimizer: OptimizerConfig, precision: str, device: torch.device
) -> dict[str, object]:
    """``block``, ``edges`` (modules), ``rope`` (cos, sin or None), ``autocast`` (a context factory), ``optimizer``
    (the run's AdamW over the block's parameters) and the shape facts the calibration record keeps to say which
    model it measured."""
    param_dtype, autocast_dtype = PRECISIONS.get(precision, (torch.float32, None))
    torch.manual_seed(0)
    block = Block(cfg, 0).to(device=device, dtype=param_dtype)
    edges = Transformer(dataclasses.replace(cfg, n_layers=1)).to(device=device, dtype=param_dtype)
    edges.blocks = nn.ModuleList()  # embedding, final norm, head: the model's parts outside its blocks
    rope = rope_cache(cfg.seq_len, cfg.head_dim, cfg.rope_theta, device=device) if cfg.pos_emb == "rope" else None

    def autocast() -> contextlib.AbstractContextManager:
        if autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=autocast_dtype)

    def block_optimizer() -> torch.optim.Optimizer:
        groups = param_groups(block, optimizer.weight_decay)
        fused = use_fused_adamw([p for g in groups for p in g["params"]], optimizer.fused)
        betas = (optimizer.beta1, optimizer.beta2)
        return torch.optim.AdamW(groups, lr=optimizer.lr, betas=betas, eps=optimizer.eps, fused=fused or None)

    factory: Callable[[], torch.optim.Optimizer] = block_optimizer
    return {
        "block": block,
        "edges": edges,
        "rope": rope,
        "autocast": autocast,
        "optimizer": factory,
        "param_dtype": param_dtype,
        "d_model": cfg.d_model,
        "vocab_size": cfg.vocab_size,
        "seq_len": cfg.seq_len,
        "block_numel": sum(p.numel() for p in block.parameters()),
    }
