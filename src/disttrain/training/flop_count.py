"""FLOPs of a user's LightningModule, counted: torch's FlopCounterMode over the run's first training micro-batch.

The count is what the module's own ``training_step`` and backward ran (matmuls, convolutions, attention; the
elementwise work of activations and optimizers is not counted, as MFU conventions leave it out), on the run's real
batch, so no formula has to know the architecture. Every rank counts, so no rank's first step runs slower than
its peers'; the first steps are outside the measured throughput anyway.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.utils.flop_counter import FlopCounterMode

from disttrain.data.samples import batch_rows


class FirstStepFlops(pl.Callback):
    """``flops_per_sample`` after the first micro-batch: its counted FLOPs over its rows (None before, or where the
    batch has no tensor to count rows from)."""

    def __init__(self) -> None:
        self.flops_per_sample: float | None = None
        self._mode: FlopCounterMode | None = None
        self._rows: int | None = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.flops_per_sample is not None or self._mode is not None or trainer.global_step or batch_idx:
            return
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
