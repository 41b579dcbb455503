"""StepLoss: a LightningModule's returned loss as ``train/loss`` at logging steps, the mean over a step's
micro-batches, and nothing where the module logs ``train/loss`` itself."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from disttrain.training.step_loss import KEY, StepLoss, logged_step_loss


class Regressor(pl.LightningModule):
    def __init__(self, own_key: str | None = None) -> None:
        super().__init__()
        self.net = nn.Linear(3, 1)
        self.own_key = own_key
        self.losses: list[tuple[int, float]] = []  # (optimizer steps before it, micro-batch loss)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append((self.trainer.global_step, float(loss.detach())))
        if self.own_key is not None:
            self.log(self.own_key, loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(tmp_path: Path, module: Regressor, accumulation: int, every: int = 3, steps: int = 7) -> pl.Trainer:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 3), torch.randn(256, 1))
    step_loss = StepLoss(every)
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, accumulate_grad_batches=accumulation,
        logger=CSVLogger(str(tmp_path)), log_every_n_steps=every, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[step_loss],
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=8))
    return trainer


def logged(tmp_path: Path) -> dict[int, float]:
    import csv

    (metrics,) = tmp_path.rglob("metrics.csv")
    with metrics.open() as rows:
        return {int(r["step"]): float(r[KEY]) for r in csv.DictReader(rows) if r.get(KEY)}


@pytest.mark.parametrize("accumulation", [1, 3])
def test_the_logged_loss_is_the_mean_of_the_logging_steps_micro_batches(tmp_path: Path, accumulation: int) -> None:
    module = Regressor()
    trainer = fit(tmp_path, module, accumulation)
    by_step: dict[int, list[float]] = {}
    for step, loss in module.losses:
        by_step.setdefault(step, []).append(loss)
    # Lightning logs a step when it completes the 3rd, 6th, ... optimizer step (steps 2, 5 counted from 0)
    expected = {step: sum(losses) / len(losses) for step, losses in by_step.items() if (step + 1) % 3 == 0}
    assert sorted(expected) == [2, 5] and all(len(by_step[s]) == accumulation for s in expected)
    got = logged(tmp_path)
    assert sorted(got) == sorted(expected)  # nothing on the other steps
    for step, value in expected.items():
        assert got[step] == pytest.approx(value, rel=1e-5)
    assert logged_step_loss(trainer) == pytest.approx(expected[5], rel=1e-5)


def test_a_module_that_logs_train_loss_itself_keeps_its_own(tmp_path: Path) -> None:
    trainer = fit(tmp_path, Regressor(own_key=KEY), 1)
    assert logged_step_loss(trainer) is None  # nothing of ours beside the module's own train/loss
    assert KEY in trainer.callback_metrics


def test_a_module_logging_another_name_still_gets_train_loss(tmp_path: Path) -> None:
    fit(tmp_path, Regressor(own_key="train_loss"), 1)
    assert sorted(logged(tmp_path)) == [2, 5]
