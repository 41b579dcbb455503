"""How an injected fault holds its rank (benchmarks/injected.py ``hold``): asleep, the thread spends no CPU; computing,
it spends the fault's time as CPU of its own, as a rank with more work does."""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks.injected import RandomTokens, SleepInBackward, hold


def cpu_of(action) -> float:
    start = time.thread_time()
    action()
    return time.thread_time() - start


def test_a_computing_hold_spends_its_time_as_this_threads_cpu_and_a_sleeping_one_none() -> None:
    assert cpu_of(lambda: hold(0.08, "compute")) >= 0.08
    assert cpu_of(lambda: hold(0.08, "sleep")) < 0.02


def test_backward_is_held_computing_and_the_gradient_passes_through_unchanged() -> None:
    x = torch.ones(3, requires_grad=True)
    y = SleepInBackward.apply(x, 0.05, "compute")
    assert cpu_of(lambda: (2 * y).sum().backward()) >= 0.05
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_an_unknown_kind_of_work_names_the_key_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"data\.work.*sleep, compute"):
        RandomTokens(seq_len=8, micro_batch_size=2, work="busy")
    with pytest.raises(ValueError, match="sleep, compute"):
        hold(0.01, "busy")
