"""Python's cyclic garbage collector kept off the objects that live for the whole run.

A full (generation-2) collection traverses every object the collector tracks. After startup that is every
object of every imported module (torch, Lightning, Hydra, torchmetrics and what they pull in), so one full
collection inside the step loop holds its rank for a tenth of a second to a second, at a step chosen by that
rank's own allocations; every other rank then waits for it in the step's next collective, and the step reads as
a straggler that no configuration of the run explains. ``gc.freeze`` after one collection at train start moves
the objects alive then into a generation the collector never scans: later full collections traverse only what
the run allocated since, and a forked loader worker does not copy the pages a collection would touch.

Garbage that exists at train start is collected first, and an object frozen there is still freed by reference
counting when the run drops it; only a frozen object caught in a reference cycle stays until the process ends,
as it would in a process that never collected.
"""

from __future__ import annotations

import gc

import lightning.pytorch as pl


class FreezeStartupObjects(pl.Callback):
    """Collect once, then freeze every object alive when training starts (see the module docstring)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        gc.collect()
        gc.freeze()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # What comes after fit (export, the report, the next job of a multirun in this process) is collected as
        # usual again.
        gc.unfreeze()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        gc.unfreeze()
