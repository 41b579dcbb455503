"""collect/deepspeed_comm over a stand-in ``deepspeed.comm`` package (the real one is exercised in
tests/dist/test_deepspeed.py): calls and async waits are timed, results pass through, the originals come back."""

from __future__ import annotations

import sys
import time
import types

import pytest

from diagnostics.collect.deepspeed_comm import time_deepspeed_collectives


class Work:
    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> bool:
        time.sleep(0.02)
        self.waited = True
        return True

    def is_completed(self) -> bool:
        return self.waited


@pytest.fixture
def fake_comm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    package = types.ModuleType("deepspeed.comm")

    def all_reduce(tensor: list, async_op: bool = False) -> Work | None:
        time.sleep(0.01)
        tensor.append("reduced")
        return Work() if async_op else None

    package.all_reduce = all_reduce  # type: ignore[attr-defined]
    package.get_rank = lambda: 0  # type: ignore[attr-defined]  # not a collective: left alone
    monkeypatch.setitem(sys.modules, "deepspeed.comm", package)
    return package


def test_sync_calls_and_async_waits_are_timed_and_pass_results_through(fake_comm: types.ModuleType) -> None:
    seen: list[float] = []
    original, get_rank = fake_comm.all_reduce, fake_comm.get_rank
    restore = time_deepspeed_collectives(seen.append)
    assert restore is not None and fake_comm.get_rank is get_rank
    tensor: list = []
    assert fake_comm.all_reduce(tensor) is None and tensor == ["reduced"]
    assert len(seen) == 1 and seen[0] >= 0.01
    handle = fake_comm.all_reduce(tensor, async_op=True)
    assert len(seen) == 2 and not handle.is_completed()  # other attributes reach the real handle
    assert handle.wait() is True and handle.is_completed()
    assert len(seen) == 3 and seen[2] >= 0.02  # the wait for the slowest rank is where async time goes
    restore()
    assert fake_comm.all_reduce is original


def test_nothing_is_patched_or_imported_without_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "deepspeed.comm", raising=False)
    assert time_deepspeed_collectives(lambda s: None) is None
    assert "deepspeed.comm" not in sys.modules
