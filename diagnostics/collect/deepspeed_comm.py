"""Time each rank spends inside DeepSpeed's collectives, so the analysis can tell waiting from work under ZeRO.

The same reason as collect/fsdp_comm: ZeRO-3 all-gathers every module's parameters just before its forward
(and again in backward), and ZeRO-1/2/3 reduce gradient buckets from backward hooks while backward still runs.
A fast rank waits for a slow one inside those collectives, in the phase they happen in, where the wait looks
exactly like slow work of its own: both ranks end forward together and no order of arrival shows who was late.

How: ZeRO calls its collectives through the ``deepspeed.comm`` package (``dist.allgather_fn``,
``dist.reduce_scatter_fn``, ``dist.all_reduce``...), looked up at call time, so replacing those package
attributes times every call; an asynchronous call returns a handle whose ``wait()`` (where the wait for the
slowest rank actually happens, e.g. ZeRO-3's prefetched all-gathers) is timed too. Only the package attributes
are replaced: calls inside ``deepspeed.comm.comm`` itself (``allgather_fn`` -> ``all_gather_into_tensor``) go
through that module's own names and are not counted twice. Where a collective is asynchronous for the host (NCCL
on a GPU) the measured time is ~0 and the analysis falls back to what it did without this signal.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

# deepspeed.comm's collectives that ZeRO issues during forward and backward (initialisation-only calls like
# broadcast_object_list are left alone).
COLLECTIVES = (
    "allgather_fn",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "reduce_scatter_fn",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all_single",
    "reduce",
    "broadcast",
)


class _TimedHandle:
    """An asynchronous collective's handle whose ``wait()`` reports its seconds; everything else passes through."""

    def __init__(self, handle: Any, report: Callable[[float], None]) -> None:
        self._handle = handle
        self._report = report

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._handle.wait(*args, **kwargs)
        finally:
            self._report(time.perf_counter() - start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _timed(call: Callable[..., Any], report: Callable[[float], None]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            result = call(*args, **kwargs)
        finally:
            report(time.perf_counter() - start)
        return _TimedHandle(result, report) if result is not None and hasattr(result, "wait") else result

    timed.__wrapped__ = call  # type: ignore[attr-defined]
    return timed


def time_deepspeed_collectives(report: Callable[[float], None]) -> Callable[[], None] | None:
    """Make ``deepspeed.comm``'s collectives report the seconds of each call (and of each async handle's wait) to
    ``report``. Returns the function that puts the originals back, or None where DeepSpeed is not loaded (a run
    that does not use it never imports it, and this does not import it either)."""
    package = sys.modules.get("deepspeed.comm")
    if package is None:
        return None
    originals = {name: getattr(package, name) for name in COLLECTIVES if callable(getattr(package, name, None))}
    for name, call in originals.items():
        setattr(package, name, _timed(call, report))

    def restore() -> None:
        for name, call in originals.items():
            setattr(package, name, call)

    return restore
