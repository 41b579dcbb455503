"""The loss a user's LightningModule optimizes, as ``train/loss`` in the run's loggers, whatever the module logs.

A built-in model logs ``train/loss`` itself. A LightningModule logs what its author chose (``train_loss``,
``loss/train``, nothing at all), yet tune's keep rule (tune/losses.py) and run.json's ``train_loss`` need the one
loss the optimizer minimized, under one name. That is the tensor ``training_step`` returned: Lightning hands it to
``on_before_backward`` already divided by the accumulation (under DeepSpeed too), so the sum over a step's
micro-batches is the step's mean, and the mean over the ranks is what a single process over the same global batch
would have seen.

Only logging steps (``trainer.log_every_n_steps``) are kept: one tensor add per micro-batch of such a step and one
scalar all-reduce and host read per logged step, nothing on the others. A module that logs ``train/loss`` itself
keeps its own (nothing is written beside it), and a module that optimizes manually is left alone (its
``manual_backward`` calls may be several losses of several optimizers, which have no single sum).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from disttrain.training.live_metrics import logging_step

KEY = "train/loss"


def module_logs_it(trainer: pl.Trainer) -> bool:
    """Whether the module itself logged ``train/loss`` (read where Lightning keeps this step's and earlier logs)."""
    if KEY in trainer.callback_metrics:
        return True
    results = getattr(trainer, "_results", None)  # this step's self.log calls ("<hook>.<name>"), not yet published
    return results is not None and any(name.endswith("." + KEY) for name in results)


class StepLoss(pl.Callback):
    """``train/loss`` every ``every_n_steps`` optimizer steps: the returned loss, mean over micro-batches and ranks."""

    def __init__(self, every_n_steps: int) -> None:
        self.every_n_steps = every_n_steps
        self.last: float | None = None  # the newest logged value: run.json's train_loss
        self._sum: torch.Tensor | None = None
        self._module_logs_it = False
        self._step = -1  # the optimizer steps before the step being summed

    def _logs_this_step(self, trainer: pl.Trainer) -> bool:
        # Lightning writes a step's metrics when the step it completes, counted from 1, is a multiple of the interval.
        return self.every_n_steps > 0 and (trainer.global_step + 1) % self.every_n_steps == 0

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._module_logs_it or not pl_module.automatic_optimization or not self._logs_this_step(trainer):
            return
        part = loss.detach().float()
        self._sum = part if self._sum is None else self._sum + part
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # Once the step is done: Lightning may call the optimizer-step hooks for every micro-batch (DeepSpeed
        # accumulates inside its engine), but the step count moves once.
        if self._sum is None or trainer.global_step == self._step:
            return
        step_loss, self._sum = self._sum, None
        if module_logs_it(trainer):  # the same on every rank: the module's logging does not depend on the rank
            self._module_logs_it = True
            return
        mean = trainer.strategy.reduce(step_loss, reduce_op="mean")
        self.last = float(mean)
        trainer._logger_connector.log_metrics({KEY: self.last}, step=logging_step(trainer))


def logged_step_loss(trainer: pl.Trainer) -> float | None:
    """The newest ``train/loss`` the run's StepLoss logged; None where there is none (or the module logs its own)."""
    return next((c.last for c in trainer.callbacks if isinstance(c, StepLoss)), None)
