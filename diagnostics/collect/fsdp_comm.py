"""Time each rank spends inside FSDP2's all-gathers and reduce-scatters, so the analysis can tell waiting from work.

Under FSDP2 a rank meets the others at every block: the all-gather before each block's forward (and again
before its backward), the reduce-scatter after its backward. A rank that is fast waits for a slow one inside
those collectives, and that wait lands in the phase it happens in (forward, backward), where it looks exactly
like slow work of its own. Timing the collectives themselves separates the two: what is left of the phase is
the rank's own work (diagnostics/kinds/straggler reads both).

How: FSDP2's public ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` take the communication object
its parameter groups call; a subclass of the default one (so FSDP's own type checks still see the default)
times each call. Only modules still on the default communication are wrapped: a user's own comm is left alone.
Where the collective is synchronous for the host (gloo on CPU) the time is the transfer plus the wait for the
slowest rank; on a GPU the call only enqueues it on a stream and the measured time is ~0, so the analysis
falls back to what it did without this signal. The cost is two ``perf_counter`` calls per collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def time_fsdp_collectives(model: torch.nn.Module, report: Callable[[float], None]) -> int:
    """Make every FSDP2 module in ``model`` report the seconds of each all-gather/reduce-scatter call to ``report``.

    Returns how many communication objects were wrapped (0: no FSDP2 module, or none on the default comm).
    """
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    except ImportError:  # a torch without FSDP2: nothing to time
        return 0

    class TimedAllGather(DefaultAllGather):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return _timed(super().__call__, report, *args, **kwargs)

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return _timed(super().__call__, report, *args, **kwargs)

    wrapped = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = getattr(module._get_fsdp_state(), "_fsdp_param_groups", [])
        if len(groups) != 1:  # FSDP2 allows a custom comm only with one parameter group per module
            continue
        if type(getattr(groups[0], "_all_gather_comm", None)) is DefaultAllGather:
            module.set_custom_all_gather(TimedAllGather())
            wrapped += 1
        if type(getattr(groups[0], "_reduce_scatter_comm", None)) is DefaultReduceScatter:
            module.set_custom_reduce_scatter(TimedReduceScatter())
            wrapped += 1
    return wrapped


def _timed(call: Callable[..., Any], report: Callable[[float], None], *args: Any, **kwargs: Any) -> Any:
    start = time.perf_counter()
    try:
        return call(*args, **kwargs)
    finally:
        report(time.perf_counter() - start)
