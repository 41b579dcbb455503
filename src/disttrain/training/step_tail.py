"""The tail of a training step as the run does it, for the TP and FSDP probes: the gradients' global norm (the
non-finite guard's, which clipping reuses), clipping with it, then the run's AdamW step. Timed over one block's
DTensor parameters against the plain block's (``diagnostics.collect.calibrate``: ``hw.tp_step_overhead_us``), and
over FSDP2-sharded units against plain ones (``diagnostics.collect.fsdp_step``: ``hw.fsdp_step_tensor_us``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from disttrain.config.schema import OptimizerConfig
from disttrain.models.probe_parts import block_optimizer
from disttrain.reliability.nan_guard import clip_with_norm, global_norm


def step_tail(module: nn.Module, optimizer: OptimizerConfig) -> Callable[[], None]:
    """One call = norm, clipping (at max_norm 1.0) and the run's AdamW step over ``module``'s gradients."""
    adamw = block_optimizer(module, optimizer)
    params = [p for p in module.parameters() if p.requires_grad]

    step = unhooked_step(adamw)

    def tail() -> None:
        clip_with_norm(params, 1.0, global_norm([p.grad for p in params if p.grad is not None]))
        step()

    return tail


def unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[[], object]:
    """``optimizer.step`` without torch's global optimizer hooks: a probe's steps are not the run's, and a hook the
    user registered for every optimizer (one that counts steps, say) must not see them. torch wraps each optimizer
    class's ``step`` with the hooks (``Optimizer.profile_hook_step``, functools.wraps); where that wrapper is not
    found, the hooked step."""
    inner = getattr(type(optimizer).step, "__wrapped__", None)
    return functools.partial(inner, optimizer) if callable(inner) else optimizer.step


def with_step_tail(parts: Callable[..., dict], optimizer: OptimizerConfig) -> Callable[..., dict]:
    """``parts`` (a TP probe's layers builder) whose dict also gives ``step_tail``: the run's tail over a module."""

    def build(*args: object, **kwargs: object) -> dict:
        return {**parts(*args, **kwargs), "step_tail": functools.partial(step_tail, optimizer=optimizer)}

    return build
