"""Pruning: a sweep job reports its validation loss to its Optuna trial at every validation, and stops cleanly
when the study's pruner says the trial is hopeless.

Only global rank 0 talks to the study (one storage connection per job, not per rank). Its verdict is broadcast at
the end of every validation, where all ranks already wait for each other (the validation loss is reduced across
them), so every rank sets ``should_stop`` after the same validation: Lightning then ends ``fit`` at that step
as at ``max_steps``, and the run finishes as usual (run.json, report) with status ``pruned``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning.pytorch as pl

from disttrain.config.schema import TrialConfig
from disttrain.sweep.study import load_trial

if TYPE_CHECKING:
    import optuna


class TrialPruning(pl.Callback):
    """Report ``metric`` (``val/loss``, or the metric a LightningModule's objective names) to the trial at each
    validation; on the pruner's word stop all ranks together."""

    def __init__(self, link: TrialConfig, rank_zero: bool, metric: str = "val/loss") -> None:
        self.link = link
        self.rank_zero = rank_zero
        self.metric = metric
        self._trial: optuna.Trial | None = None
        self.pruned_at: int | None = None  # the step the run was pruned at (None: not pruned)
        self.reported: dict[int, float] = {}

    def trial(self) -> optuna.Trial:
        if self._trial is None:
            self._trial = load_trial(self.link)
        return self._trial

    def verdict(self, step: int, value: float | None, last: bool) -> bool:
        """Rank 0: report ``value`` at ``step``; whether the pruner stops the trial (never after the last step:
        a finished trial is complete, not pruned)."""
        if value is None:
            return False
        trial = self.trial()
        trial.report(value, step)
        self.reported[step] = value
        return not last and trial.should_prune()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        step = trainer.global_step
        prune = False
        if self.rank_zero:
            loss = trainer.callback_metrics.get(self.metric)
            prune = self.verdict(step, float(loss) if loss is not None else None, step >= (trainer.max_steps or 0))
        if trainer.world_size > 1:
            prune = bool(trainer.strategy.broadcast(prune, src=0))
        if prune:
            self.pruned_at = step
            trainer.should_stop = True
