"""Trainer callbacks every run gets: step checkpoints, a final validation, and train-only throughput."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl

from disttrain.checkpoints import (
    checkpoint_name,
    discover,
    is_complete,
    publish,
    relink_last,
    remove_partials,
    remove_path,
    staging_dir,
    to_delete_for_retention,
)


class FinalValidation(pl.Callback):
    """At ``max_steps``, ask Lightning to validate before it stops (it does so when ``should_stop`` is set).

    With a step-based endless loader Lightning would otherwise end without validating the final weights.
    """

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True


class StepCheckpoint(pl.Callback):
    """``step<N>.ckpt`` every ``every_n_steps`` optimizer steps and at the last step; ``last.ckpt`` links the newest.

    ``trainer.save_checkpoint`` is collective (FSDP2 writes one shard per rank), so every rank runs this. Each
    checkpoint (file or directory, with any sidecars) is written into a staging dir and renamed into place once
    complete (see ``disttrain.checkpoints``); ``keep_last_n`` then deletes older complete ones, never the newest.
    ``skip_save`` vetoes a due save (the non-finite guard stopping on a bad step); ``before_publish`` runs
    between writing and renaming (fault injection for the kill-during-save tests).
    """

    def __init__(
        self,
        ckpt_dir: Path,
        every_n_steps: int,
        keep_last_n: int | None = None,
        skip_save: Callable[[], bool] | None = None,
        before_publish: Callable[[int], None] | None = None,
    ) -> None:
        self.ckpt_dir = ckpt_dir
        self.every_n_steps = every_n_steps
        self.keep_last_n = keep_last_n
        self.skip_save = skip_save
        self.before_publish = before_publish
        self.last_saved_step = -1

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        step = trainer.global_step
        # Under gradient accumulation this hook runs on every micro-batch; save once per optimizer step.
        if step == self.last_saved_step or step == 0:
            return
        if step % self.every_n_steps and step < trainer.max_steps:
            return
        if self.skip_save is not None and self.skip_save():
            return
        self.last_saved_step = step
        self.save(trainer, step)

    def save(self, trainer: pl.Trainer, step: int) -> None:
        name = checkpoint_name(step)
        staging = staging_dir(self.ckpt_dir, step)
        if trainer.is_global_zero:
            remove_partials(self.ckpt_dir)  # leftovers of a save killed earlier (this run or a restarted one)
            staging.mkdir(parents=True)
        trainer.strategy.barrier("checkpoint-prepare")
        # Strategies write the checkpoint (and any sidecar derived from its path) into the staging dir.
        trainer.save_checkpoint(staging / name, weights_only=False)  # ends with a barrier: all parts written
        if self.before_publish is not None:
            self.before_publish(step)
        if trainer.is_global_zero:
            publish(staging, self.ckpt_dir, name)
            relink_last(self.ckpt_dir, name)
            self.apply_retention(self.ckpt_dir / name)
        trainer.strategy.barrier("step-checkpoint")

    def apply_retention(self, newest: Path) -> None:
        if not is_complete(newest):  # never thin out older checkpoints unless the new one is whole
            return
        for path in to_delete_for_retention(discover(self.ckpt_dir), self.keep_last_n):
            remove_path(path)


class Throughput(pl.Callback):
    """Tokens per second over training steps only (validation and the first ``skip_steps`` excluded)."""

    def __init__(self, tokens_per_step: int, skip_steps: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.skip_steps = skip_steps
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
            return
        self.train_time_s = now - self.start - self.excluded_s
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
        print("  ".join(parts), flush=True)
