"""The tail of a training step as the run does it, for the TP and FSDP probes: the gradients' global norm (the
non-finite guard's, which clipping reuses), clipping with it, then the run's AdamW step. Timed over one block's
DTensor parameters against the plain block's (``diagnostics.collect.calibrate``: ``hw.tp_step_overhead_us``), and
over FSDP2-sharded units against plain ones (``diagnostics.collect.fsdp_step``: ``hw.fsdp_step_tensor_us``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import nn

from diagnostics.collect.unhooked import unhooked_step
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


def with_step_tail(parts: Callable[..., dict], optimizer: OptimizerConfig) -> Callable[..., dict]:
    """``parts`` (a TP probe's layers builder) whose dict also gives ``step_tail``: the run's tail over a module."""

    def build(*args: object, **kwargs: object) -> dict:
        return {**parts(*args, **kwargs), "step_tail": functools.partial(step_tail, optimizer=optimizer)}

    return build
