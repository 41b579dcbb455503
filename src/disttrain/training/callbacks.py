"""Trainer callbacks every run gets: a final validation and train-only throughput (progress: progress.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

import lightning.pytorch as pl


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
