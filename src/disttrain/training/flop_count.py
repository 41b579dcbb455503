"""FLOPs of a user's LightningModule, counted: torch's FlopCounterMode over the run's first training micro-batch.

The count is what the module's own ``training_step`` and backward ran (matmuls, convolutions, attention; the
elementwise work of activations and optimizers is not counted, as MFU conventions leave it out), on the run's real
batch, so no formula has to know the architecture. Every rank counts, so no rank's first step runs slower than
its peers'; the first steps are outside the measured throughput anyway.

A module holding compiled code (``model.compile``, or the user's own ``torch.compile`` of a submodule) is counted
on its second micro-batch instead: dynamo leaves code that first runs under a dispatch mode (the counter is one)
eager for good, so counting the first call would silently undo the compile; once compiled, a counted call runs
the same ops eagerly and later calls keep the compiled graph.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from disttrain.data.samples import batch_rows


def is_compiled(module: nn.Module) -> bool:
    """Compiled in place (``nn.Module.compile``), wrapped (``torch.compile(module)``) or by its forward
    (``module.forward = torch.compile(module.forward)``, what ``model.compile`` does to a LightningModule's parts)."""
    forward = vars(module).get("forward")
    return (
        getattr(module, "_compiled_call_impl", None) is not None
        or hasattr(module, "_orig_mod")
        or hasattr(forward, "_torchdynamo_orig_callable")
    )


def holds_compiled_code(module: nn.Module) -> bool:
    """Whether the module or any submodule is compiled (``is_compiled``)."""
    return any(is_compiled(m) for m in module.modules())


class FirstStepFlops(pl.Callback):
    """``flops_per_sample`` after the micro-batch it counts (the first; the second where compiled): its FLOPs over its
    rows (None before, or where the batch has no tensor to count rows from)."""

    def __init__(self) -> None:
        self.flops_per_sample: float | None = None
        self._mode: FlopCounterMode | None = None
        self._rows: int | None = None
        self._counted_at: int | None = None  # the micro-batch counted: the first, or the second under compile
        self._done = False  # counted (or given up on): no work on later batches

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._done or self._mode is not None:
            return
        if self._counted_at is None:  # once: the module is configured (and compiled) by the first batch
            self._counted_at = 1 if holds_compiled_code(pl_module) else 0
        if trainer.global_step > self._counted_at:  # past it, or a resumed run: its first batches are not the run's
            self._done = True
            return
        if batch_idx != self._counted_at:
            return
        self._done = True
        self._rows = batch_rows(batch)
        if not self._rows:
            return
        self._mode = FlopCounterMode(display=False)
        self._mode.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            return
        mode.__exit__(None, None, None)
        total = mode.get_total_flops()
        if total > 0 and self._rows:
            self.flops_per_sample = total / self._rows

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
