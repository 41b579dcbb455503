"""A probe's optimizer steps are not the run's: torch's global optimizer hooks (``register_optimizer_step_pre_hook``
and ``..._post_hook``, which a user may have registered to count or log the run's steps) must not see them."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[[], object]:
    """``optimizer.step`` without the global hooks. torch wraps each optimizer class's ``step`` with them
    (``Optimizer.profile_hook_step``, via functools.wraps); where that wrapper is not found, the hooked step."""
    inner = getattr(type(optimizer).step, "__wrapped__", None)
    return functools.partial(inner, optimizer) if callable(inner) else optimizer.step
