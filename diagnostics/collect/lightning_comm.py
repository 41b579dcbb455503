"""The collectives a LightningModule issues through its strategy: ``self.log(..., sync_dist=True)`` reduces each
value across the ranks inside ``training_step`` (Lightning's ``strategy.reduce``), and ``self.all_gather`` gathers.

A rank that arrives first at such a reduce waits there for the last one, inside its own forward: untimed, that
wait reads as forward compute on every rank but the late one, and a straggler looks like all ranks being slow.
Timed, the wait is the collective's (the step's analysis charges it to the rank that arrived last).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

TIMED = ("reduce", "all_gather")


def time_lightning_collectives(strategy: Any, report: Callable[[float], None]) -> Callable[[], None] | None:
    """Make ``strategy``'s reduce and all_gather report each call's seconds to ``report``; returns the undo (None on
    one process, where they communicate nothing)."""
    if getattr(strategy, "world_size", 1) < 2:
        return None
    originals = {name: getattr(strategy, name) for name in TIMED if callable(getattr(strategy, name, None))}

    def timed(call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                report(time.perf_counter() - start)

        return run

    for name, call in originals.items():
        setattr(strategy, name, timed(call))

    def undo() -> None:
        for name in originals:
            strategy.__dict__.pop(name, None)  # the class's own method again

    return undo
