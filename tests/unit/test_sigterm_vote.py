"""SIGTERM rides in the non-finite guard's per-step vote (reliability/sigterm.py): a real single-process Trainer,
with the vote's other ranks simulated."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from disttrain.reliability import nan_guard
from disttrain.reliability.nan_guard import NonFiniteGuard
from disttrain.reliability.sigterm import SigtermInVote

# A bare Trainer here (this box has srun; Lightning's pytree helper uses a deprecated torch check): not ours to show.
pytestmark = pytest.mark.filterwarnings(
    "ignore:The `srun` command is available", "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"
)


class Regression(pl.LightningModule):
    def __init__(self, signal_at: int | None = None, signum: int = signal.SIGTERM) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.signal_at = signal_at
        self.signum = signum

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == self.signal_at:
            os.kill(os.getpid(), self.signum)  # arrives mid-step, as a scheduler's would
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(module: Regression, tmp_path: object) -> tuple[pl.Trainer, SigtermInVote, list[int]]:
    guard = NonFiniteGuard("stop", max_skips=0)
    sigterm = SigtermInVote()
    guard.riders.append(sigterm)
    steps_ended: list[int] = []

    class Steps(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            steps_ended.append(trainer.global_step)

    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = pl.Trainer(
        max_steps=10, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[guard, sigterm, Steps()],
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    with pytest.raises(SIGTERMException):
        trainer.fit(module, DataLoader(data, batch_size=4))
    return trainer, sigterm, steps_ended


def test_another_ranks_sigterm_in_the_vote_ends_fit_after_the_same_batch(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This rank got no signal; the vote at step 3 carries another rank's: fit ends after that batch, here too."""
    real_vote = nan_guard.cast_vote
    calls: list[int] = []

    def vote_with_another_rank(flags: list[torch.Tensor]) -> torch.Tensor:
        calls.append(len(flags))
        verdict = real_vote(flags)
        if len(calls) == 3:
            verdict[3] = 4.0  # the max over ranks: rank 3 received SIGTERM
        return verdict

    monkeypatch.setattr(nan_guard, "cast_vote", vote_with_another_rank)
    trainer, sigterm, steps_ended = fit(Regression(), tmp_path)
    assert sigterm.installed and sigterm.votes == 3 and sigterm.signalled_rank == 3
    assert calls == [4, 4, 4]  # loss, norm's finiteness, the norm itself and the SIGTERM flag in one vote per step
    assert steps_ended == [1, 2, 3] and trainer.global_step == 3


def test_this_ranks_sigterm_is_flagged_by_the_handler_and_voted(tmp_path: object) -> None:
    """The handler only sets the flag (Lightning's broadcasts from inside it); the step's vote carries it."""
    before = signal.getsignal(signal.SIGTERM)
    trainer, sigterm, steps_ended = fit(Regression(signal_at=4), tmp_path)
    assert steps_ended == [1, 2, 3, 4, 5] and sigterm.votes == 5  # the signal came in the fifth batch (index 4)
    assert sigterm.signalled_rank == 0
    assert trainer.received_sigterm and trainer._signal_connector._sigterm_notifier_fn == sigterm._notify
    assert signal.getsignal(signal.SIGTERM) == before  # Lightning put the previous handler back


def test_lightnings_per_batch_broadcast_runs_only_until_the_first_vote() -> None:
    """Before it, Lightning's broadcast sends rank 0's own flag (set only for the call); after it, the votes do."""
    sigterm = SigtermInVote()
    sigterm.installed, sigterm._connector = True, SimpleNamespace(received_sigterm=False)
    sent: list[bool] = []
    before_batch = sigterm._before_batch(lambda: sent.append(sigterm._connector.received_sigterm))
    before_batch()
    sigterm.received = True  # the handler ran
    before_batch()
    assert sent == [False, True] and not sigterm._connector.received_sigterm  # no rank-local stop at batch end
    sigterm.agreed(None, 0.0)  # type: ignore[arg-type]
    before_batch()
    assert sent == [False, True]


def test_rank_zeros_flag_broadcast_before_the_first_vote_is_recorded_as_rank_zeros() -> None:
    sigterm = SigtermInVote()
    sigterm._connector = SimpleNamespace(received_sigterm=False)

    def broadcast() -> None:
        raise SIGTERMException()  # what Lightning's broadcast does on every rank when rank 0's flag is set

    with pytest.raises(SIGTERMException):
        sigterm._before_batch(broadcast)()
    assert sigterm.signalled_rank == 0 and sigterm._connector.received_sigterm


def test_without_lightnings_hooks_nothing_is_replaced_and_the_flag_stays_out_of_the_vote(
    tmp_path: object,
) -> None:
    sigterm = SigtermInVote()
    trainer = pl.Trainer(max_steps=1, logger=False, default_root_dir=str(tmp_path))
    del trainer._signal_connector  # a Lightning without the connector's hook
    sigterm.setup(trainer, None, "fit")  # type: ignore[arg-type]
    assert not sigterm.installed and not sigterm.flag(trainer)
    assert "_broadcast_sigterm_tensor" not in vars(trainer.fit_loop.epoch_loop)
