"""The startup objects are out of the cyclic collector's reach for the step loop, and back in it after fit."""

from __future__ import annotations

import gc
import weakref

import pytest

from disttrain.training.gc_freeze import FreezeStartupObjects


@pytest.fixture(autouse=True)
def _unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_train_start_collects_the_garbage_then_freezes_what_is_alive() -> None:
    class Cycle:
        def __init__(self) -> None:
            self.me = self

    garbage = weakref.ref(Cycle())  # a cycle: only a collection frees it
    alive = [object() for _ in range(10)]
    callback = FreezeStartupObjects()
    callback.on_train_start(None, None)  # type: ignore[arg-type]
    assert gc.get_freeze_count() > len(alive)
    assert garbage() is None  # collected before the freeze, not frozen with the rest
    callback.on_train_end(None, None)  # type: ignore[arg-type]
    assert gc.get_freeze_count() == 0


def test_a_failed_fit_unfreezes_too() -> None:
    callback = FreezeStartupObjects()
    callback.on_train_start(None, None)  # type: ignore[arg-type]
    callback.on_exception(None, None, RuntimeError("boom"))  # type: ignore[arg-type]
    assert gc.get_freeze_count() == 0
