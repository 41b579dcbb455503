"""Trainer callbacks every run gets: a final validation, train-only throughput and progress lines."""

from __future__ import annotations

import time
from collections.abc import Callable

import lightning.pytorch as pl

from disttrain.launch.env import say


class FinalValidation(pl.Callback):
    """At ``max_steps``, ask Lightning to validate before it stops (it does so when ``should_stop`` is set).

    With a step-based endless loader Lightning would otherwise end without validating the final weights.
    """

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True


class Throughput(pl.Callback):
    """Tokens per second over training steps only: validation, checkpoint writes and the first ``skip_steps``
    excluded (``saving_s`` reports the seconds spent saving so far; a save runs inside a step's end hooks)."""

    def __init__(self, tokens_per_step: int, skip_steps: int, saving_s: Callable[[], float] | None = None) -> None:
        self.tokens_per_step = tokens_per_step
        self.skip_steps = skip_steps
        self.saving_s = saving_s or (lambda: 0.0)
        self._saving_at_start = 0.0
        self.start: float | None = None
        self.start_step = 0
        self.excluded_s = 0.0
        self._val_start: float | None = None
        self.tokens_per_s: float | None = None
        self.train_time_s = 0.0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        step = trainer.global_step
        now = time.perf_counter()
        if self.start is None:
            if step >= self.skip_steps:
                self.start, self.start_step = now, step
                self._saving_at_start = self.saving_s()
            return
        saving = self.saving_s() - self._saving_at_start
        self.train_time_s = now - self.start - self.excluded_s - saving
        if step > self.start_step and self.train_time_s > 0:
            self.tokens_per_s = (step - self.start_step) * self.tokens_per_step / self.train_time_s

    def on_validation_start(self, *args: object) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, *args: object) -> None:
        if self._val_start is not None and self.start is not None:
            self.excluded_s += time.perf_counter() - self._val_start
        self._val_start = None


class ProgressPrinter(pl.Callback):
    """About ten one-line progress reports per run from rank 0 (a progress bar is noise in cluster logs)."""

    def __init__(self, every_n_steps: int, throughput: Throughput) -> None:
        self.every_n_steps = max(1, every_n_steps)
        self.throughput = throughput
        self.last_printed = -1

    @staticmethod
    def interval(max_steps: int, log_every_n_steps: int) -> int:
        """A multiple of the logging interval (so the loss shown is fresh) near a tenth of the run."""
        return log_every_n_steps * max(1, round(max_steps / 10 / log_every_n_steps))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        step = trainer.global_step
        due = step % self.every_n_steps == 0 or step >= trainer.max_steps
        if not trainer.is_global_zero or step == self.last_printed or not due:
            return
        self.last_printed = step
        metrics = trainer.callback_metrics
        parts = [f"step {step}/{trainer.max_steps}"]
        if "train/loss" in metrics:
            parts.append(f"loss {float(metrics['train/loss']):.4f}")
        if "val/loss" in metrics:
            parts.append(f"val {float(metrics['val/loss']):.4f}")
        lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None
        if lr is not None:
            parts.append(f"lr {lr:.2e}")
        if self.throughput.tokens_per_s:
            parts.append(f"{self.throughput.tokens_per_s:,.0f} tok/s")
        say("  ".join(parts))
