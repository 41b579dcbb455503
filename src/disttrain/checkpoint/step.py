"""The step-checkpoint callback: ``step<N>.ckpt`` written atomically by every rank, ``last.ckpt`` relinked."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl

from disttrain.checkpoint.files import (
    checkpoint_name,
    discover,
    is_complete,
    publish,
    record_sizes,
    relink_last,
    remove_partials,
    remove_path,
    staging_dir,
    to_delete_for_retention,
)


class StepCheckpoint(pl.Callback):
    """``step<N>.ckpt`` every ``every_n_steps`` optimizer steps and at the last step; ``last.ckpt`` links the newest.

    ``trainer.save_checkpoint`` is collective (FSDP2 writes one shard per rank), so every rank runs this. Each
    checkpoint (file or directory, with any sidecars) is written into a staging dir and renamed into place once
    complete (see ``disttrain.checkpoint.files``); ``keep_last_n`` then deletes older complete ones, never the newest.
    ``skip_save`` vetoes a due save (the non-finite guard stopping on a bad step); ``before_write`` runs just before
    the write and ``before_publish`` between writing and renaming (fault injection: ``reliability/faults.py``).
    """

    def __init__(
        self,
        ckpt_dir: Path,
        every_n_steps: int,
        keep_last_n: int | None = None,
        skip_save: Callable[[], bool] | None = None,
        before_publish: Callable[[int], None] | None = None,
        before_write: Callable[[int, Path], None] | None = None,
    ) -> None:
        self.ckpt_dir = ckpt_dir
        self.every_n_steps = every_n_steps
        self.keep_last_n = keep_last_n
        self.skip_save = skip_save
        self.before_publish = before_publish
        self.before_write = before_write
        self.last_saved_step = -1
        self.saving_step: int | None = None  # the step whose checkpoint is being written: a crash site
        self.save_s = 0.0  # seconds spent saving so far: not training time (Throughput leaves it out)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        step = trainer.global_step
        # Under gradient accumulation this hook runs on every micro-batch; save once per optimizer step.
        # every_n_steps=0: no step checkpoints (a signal's checkpoint, preemption.py, calls save() itself).
        if step == self.last_saved_step or step == 0 or not self.every_n_steps:
            return
        if step % self.every_n_steps and step < trainer.max_steps:
            return
        if self.skip_save is not None and self.skip_save():
            return
        self.last_saved_step = step
        self.saving_step = step
        self.save(trainer, step)
        self.saving_step = None  # left set if the save raised: the crash record names the checkpoint of this step

    def save(self, trainer: pl.Trainer, step: int) -> None:
        start = time.perf_counter()
        try:
            self._save(trainer, step)
        finally:
            self.save_s += time.perf_counter() - start

    def _save(self, trainer: pl.Trainer, step: int) -> None:
        name = checkpoint_name(step)
        staging = staging_dir(self.ckpt_dir, step)
        if trainer.is_global_zero:
            remove_partials(self.ckpt_dir)  # leftovers of a save killed earlier (this run or a restarted one)
            staging.mkdir(parents=True)
        trainer.strategy.barrier("checkpoint-prepare")
        if self.before_write is not None:
            self.before_write(step, staging / name)
        # Strategies write the checkpoint (and any sidecar derived from its path) into the staging dir.
        trainer.save_checkpoint(staging / name, weights_only=False)  # ends with a barrier: all parts written
        if self.before_publish is not None:
            self.before_publish(step)
        if trainer.is_global_zero:
            record_sizes(staging / name)
            publish(staging, self.ckpt_dir, name)
            relink_last(self.ckpt_dir, name)
            self.apply_retention(self.ckpt_dir / name)
        trainer.strategy.barrier("step-checkpoint")

    def apply_retention(self, newest: Path) -> None:
        if not is_complete(newest):  # never thin out older checkpoints unless the new one is whole
            return
        for path in to_delete_for_retention(discover(self.ckpt_dir), self.keep_last_n):
            remove_path(path)
