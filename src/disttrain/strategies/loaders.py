"""Every strategy's DataLoaders, as the strategy hands them to Lightning's loops."""

from __future__ import annotations

from typing import Any

from disttrain.reliability.fork_guard import guard_dataloader


class ForkGuardedLoaders:
    """Mixin for a Lightning ``Strategy``: a loader that forks its workers gets workers that cannot hang inside
    their fork on a Python with CPython's fork deadlock (``disttrain.reliability.fork_guard``), the user's own
    loaders included (Lightning passes each one here before it starts its workers)."""

    def process_dataloader(self, dataloader: object) -> object:
        parent: Any = super()
        return parent.process_dataloader(guard_dataloader(dataloader))
