"""SLURM's warning signal rides in the non-finite guard's per-step vote (reliability/preemption.py): a real
single-process Trainer built with ``build_reliability(preemptible=True)``."""

from __future__ import annotations

import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from disttrain.config.schema import TrainerConfig
from disttrain.reliability.callbacks import build_reliability
from disttrain.reliability.preemption import Preempted
from tests.unit.test_sigterm_vote import Regression

pytestmark = pytest.mark.filterwarnings(
    "ignore:The `srun` command is available", "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"
)


def test_the_warning_signal_is_decided_by_the_guards_vote_and_saves_that_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reliability = build_reliability(TrainerConfig(ckpt_every_n_steps=100), tmp_path / "ckpt", preemptible=True)
    preemption = reliability.preemption
    assert preemption is not None and reliability.guard.riders[-1] is preemption
    trainer = pl.Trainer(
        max_steps=10, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
        callbacks=[*reliability.callbacks, preemption], default_root_dir=str(tmp_path),
    )  # fmt: skip
    own_collectives: list[bool] = []
    real_decision = trainer.strategy.reduce_boolean_decision

    def counted(decision: bool, all: bool = True) -> bool:
        own_collectives.append(decision)
        return real_decision(decision, all=all)

    monkeypatch.setattr(trainer.strategy, "reduce_boolean_decision", counted)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    # Batch index 8 is step 5's first micro-batch: the signal comes before step 5's vote, which carries it.
    with pytest.raises(Preempted) as stop:
        trainer.fit(Regression(signal_at=8, signum=signal.SIGUSR2), DataLoader(data, batch_size=4))
    assert (stop.value.step, stop.value.signal_name) == (5, "SIGUSR2")
    assert stop.value.checkpoint == tmp_path / "ckpt" / "step000005.ckpt" and stop.value.checkpoint.is_file()
    assert preemption.votes == 5 and preemption.voted == signal.SIGUSR2
    # Only step 0's first micro-batch end came before any vote: the one collective of its own in the whole run.
    assert own_collectives == [False]
