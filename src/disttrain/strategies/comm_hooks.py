"""``strategy.comm_hook``: which torch DDP communication hook runs the gradient all-reduce, and its state.

No ``from __future__ import annotations`` here or in ``powersgd``: DDP inspects a hook's signature and refuses
annotations that are strings.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from disttrain.config.strategy_schema import DDPConfig
from disttrain.strategies.powersgd import PowerSGDComm, powersgd_hook


def bf16_hook_for_gloo(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16 compression hook under another name.

    DDP refuses a hook *named* ``bf16_compress_hook`` unless CUDA with NCCL >= 2.10 is present (older NCCL had no
    bf16). gloo all-reduces bf16 tensors correctly (checked with torch 2.13), so on gloo the same hook runs under
    this name; on NCCL torch's own check still applies.
    """
    return default_hooks.bf16_compress_hook(process_group, bucket)


def build_comm_hook(cfg: DDPConfig, backend: str) -> tuple[object | None, Callable | None]:
    """(state, hook) for ``cfg.comm_hook``; (None, None) leaves DDP's built-in all-reduce."""
    if cfg.comm_hook == "none":
        return None, None
    if cfg.comm_hook == "powersgd":
        return PowerSGDComm(cfg.powersgd_rank, cfg.powersgd_warmup_steps, cfg.powersgd_error_feedback), powersgd_hook
    # The compression hooks take the process group as their state; None means the default (world) group.
    if cfg.comm_hook == "fp16":
        return None, default_hooks.fp16_compress_hook
    if cfg.comm_hook == "bf16":
        return None, bf16_hook_for_gloo if backend == "gloo" else default_hooks.bf16_compress_hook
    raise ValueError(f"unknown comm hook {cfg.comm_hook!r}")  # validate_ddp refuses it before anything starts
