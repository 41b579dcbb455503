"""The non-finite guard's GPU path: the bad step is skipped on the device (fused AdamW's ``found_inf``) and the
verdict is read one step later, so no step waits for the device. Run here on CPU tensors with the path forced
(torch's fused AdamW honours ``found_inf`` on CPU too); on a GPU ``defers_verdict`` picks it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from disttrain.reliability.nan_guard import NonFiniteGuard, defers_verdict


class Run:
    """A tiny model, its fused AdamW and a guard, stepped the way Lightning calls them."""

    def __init__(self, policy: str = "skip", max_skips: int = 5, defer: bool = True, clip: float | None = 1.0):
        torch.manual_seed(0)
        self.model = nn.Linear(4, 3)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1, fused=True)
        self.records: list[tuple] = []
        self.guard = NonFiniteGuard(policy, max_skips, record=self._record, clip_norm=clip)
        self.guard.defer = defer
        self.trainer = SimpleNamespace(
            strategy=SimpleNamespace(root_device=torch.device("cpu")), global_step=0, should_stop=False
        )

    def _record(self, kind: str, **fields: object) -> None:
        self.records.append((fields["step"], fields["action"]))

    def step(self, grad: float, loss: float = 1.0) -> None:
        for p in self.model.parameters():
            p.grad = torch.full_like(p, grad)
        self.guard.on_before_backward(self.trainer, self.model, torch.tensor(loss))  # type: ignore[arg-type]
        self.guard.on_before_optimizer_step(self.trainer, self.model, self.optimizer)  # type: ignore[arg-type]
        self.optimizer.step()
        self.trainer.global_step += 1

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def steps_taken(self) -> float:
        return float(self.optimizer.state[self.model.weight]["step"])


def test_a_bad_step_is_skipped_on_the_device_and_counted_one_step_later() -> None:
    run = Run("skip")
    run.step(0.5)
    after_first = run.weights()
    run.step(float("nan"))
    assert all(torch.equal(a, b) for a, b in zip(after_first, run.weights(), strict=True))  # no update
    assert run.steps_taken() == 1.0  # Adam's step count restored as well
    assert run.guard.skipped_steps == []  # not read yet: nothing waited for the device
    run.step(0.5)
    assert run.guard.skipped_steps == [1] and run.records == [(1, "skipped")]
    assert run.steps_taken() == 2.0 and not run.trainer.should_stop


def test_a_stop_skips_the_next_update_too_so_the_weights_stay_the_last_good_ones() -> None:
    run = Run("stop")
    run.step(0.5)
    good = run.weights()
    run.step(0.5, loss=float("inf"))
    run.step(0.5, loss=float("nan"))  # its verdict on step 1 stops the run: this update is skipped as well
    assert run.guard.stopped_at == 1 and run.trainer.should_stop
    run.guard.settle()  # the end of training reads step 2's (bad) verdict: still the stop at step 1
    assert run.guard.stopped_at == 1 and len(run.records) == 1
    assert "non-finite loss at step 1" in str(run.guard.stop_reason)
    assert all(torch.equal(a, b) for a, b in zip(good, run.weights(), strict=True))


def test_settle_reads_a_pending_verdict_at_once_before_a_checkpoint_or_the_end() -> None:
    run = Run("stop")
    run.step(0.5)
    run.step(float("inf"))
    assert run.guard.stopped_at is None
    assert run.guard.settle() is True and run.guard.stopped_at == 1
    assert run.guard.settle() is False  # nothing pending any more


def test_finite_steps_train_exactly_as_the_step_read_path_does() -> None:
    deferred, immediate = Run(defer=True), Run(defer=False)
    for grad in (0.5, -2.0, 3.0, 0.1):
        deferred.step(grad)
        immediate.step(grad)
    assert all(torch.equal(a, b) for a, b in zip(deferred.weights(), immediate.weights(), strict=True))
    assert deferred.guard.skipped_steps == immediate.guard.skipped_steps == []


def fused(device: str = "cpu") -> torch.optim.Optimizer:
    return torch.optim.AdamW([nn.Parameter(torch.ones(2))], fused=True)


@pytest.mark.parametrize(
    ("device", "optimizer", "scaler", "defers"),
    [
        ("cuda", "fused", False, True),
        ("cpu", "fused", False, False),  # no sync to save: the verdict is read in its own step
        ("cuda", "foreach", False, False),  # foreach AdamW ignores found_inf
        ("cuda", "fused", True, False),  # fp16's GradScaler owns found_inf
    ],
)
def test_the_gpu_path_is_taken_only_where_the_optimizer_can_skip_on_the_device(device, optimizer, scaler, defers):
    params = [nn.Parameter(torch.ones(2))]
    opt = torch.optim.AdamW(params, fused=True) if optimizer == "fused" else torch.optim.AdamW(params)
    assert defers_verdict(opt, torch.device(device), scaler) is defers


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "read-in-step"])
def test_the_norm_before_clipping_rides_in_the_vote_to_the_host(defer: bool) -> None:
    """The logger's gradient norm: clip_grad_norm_'s total norm before clipping, read with the verdict (a step late
    where the verdict is), never by a read of its own."""
    run = Run("skip", defer=defer)
    run.step(0.5)
    expected = torch.nn.utils.get_total_norm([torch.full((3, 4), 0.5), torch.full((3,), 0.5)]).item()
    if defer:
        assert run.guard.last_grad_norm is None  # not read yet
        run.step(2.0)
    assert run.guard.last_grad_norm == (0, pytest.approx(expected))  # 0.5 * sqrt(15), well above the clip at 1


def test_without_clipping_the_guard_offers_no_norm() -> None:
    """Unclipped, the guard's norm is this rank's shard or stage only under FSDP or a pipeline: not the global one."""
    run = Run("skip", defer=False, clip=None)
    run.step(0.5)
    run.step(0.5)
    assert run.guard.last_grad_norm is None
