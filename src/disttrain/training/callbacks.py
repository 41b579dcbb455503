"""Trainer callbacks every run gets: a final validation and train-only throughput (progress: progress.py)."""

from __future__ import annotations

import statistics
import time
from array import array
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
    """Work per second over training steps only: validation, checkpoint writes and the first ``skip_steps``
    excluded (``saving_s`` reports the seconds spent saving so far; a save runs inside a step's end hooks).

    The unit of work is the sample; a token model's are counted in tokens (``unit="token"``).

    Also each optimizer step's duration (end hooks to end hooks, a step with a validation or a save in it left
    out): ``step_time_p50_s``, the median, is the steady rate a long run converges to, which one burst of other
    work on a shared machine moves far less than the mean over the run.
    """

    def __init__(
        self,
        units_per_step: int,
        skip_steps: int,
        saving_s: Callable[[], float] | None = None,
        unit: str = "token",
    ) -> None:
        self.units_per_step = units_per_step
        self.unit = unit
        self.skip_steps = skip_steps
        self.saving_s = saving_s or (lambda: 0.0)
        self._saving_at_start = 0.0
        self.start: float | None = None
        self.start_step = 0
        self.excluded_s = 0.0
        self._val_start: float | None = None
        self.units_per_s: float | None = None
        self.train_time_s = 0.0
        self.step_times_s = array("d")  # 8 bytes a step: a million steps hold 8 MB
        self._last_step = -1
        self._last_end: tuple[float, float, float] | None = None  # (time, excluded_s, saving_s) at the last step end

    @property
    def tokens_per_s(self) -> float | None:
        return self.units_per_s if self.unit == "token" else None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        step = trainer.global_step
        now = time.perf_counter()
        saving_total = self.saving_s()
        if step != self._last_step:  # under accumulation this hook runs per micro-batch: time optimizer steps
            if self._last_end is not None and step == self._last_step + 1 and step > self.skip_steps:
                last_time, last_excluded, last_saving = self._last_end
                if self.excluded_s == last_excluded and saving_total == last_saving:
                    self.step_times_s.append(now - last_time)
            self._last_step, self._last_end = step, (now, self.excluded_s, saving_total)
        if self.start is None:
            if step >= self.skip_steps:
                self.start, self.start_step = now, step
                self._saving_at_start = saving_total
            return
        saving = saving_total - self._saving_at_start
        self.train_time_s = now - self.start - self.excluded_s - saving
        if step > self.start_step and self.train_time_s > 0:
            self.units_per_s = (step - self.start_step) * self.units_per_step / self.train_time_s

    @property
    def step_time_p50_s(self) -> float | None:
        """The median duration of an optimizer step after the warm-up (None before two steps were timed)."""
        return statistics.median(self.step_times_s) if len(self.step_times_s) >= 2 else None

    def on_validation_start(self, *args: object) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, *args: object) -> None:
        if self._val_start is not None and self.start is not None:
            self.excluded_s += time.perf_counter() - self._val_start
        self._val_start = None
