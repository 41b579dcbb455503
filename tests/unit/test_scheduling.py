"""The suite's own scheduling under pytest-xdist (tests/scheduling.py): timed tests alone."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest

from tests.scheduling import SHARED_TIMED_RUN, heaviest_files_first, held, mark_exclusive_users_of_timed_runs


def test_an_exclusive_holder_waits_for_the_shared_one_and_then_keeps_later_ones_out(monkeypatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", uuid.uuid4().hex)  # a lock of its own, not this run's
    events: list[str] = []
    shared_in, exclusive_waiting = threading.Event(), threading.Event()

    def shared(name: str, hold_s: float, after: threading.Event | None = None) -> None:
        if after is not None:
            after.wait()
            time.sleep(0.1)  # the exclusive one is queued by now
        with held(exclusive=False):
            events.append(f"{name} in")
            shared_in.set()
            time.sleep(hold_s)
            events.append(f"{name} out")

    def exclusive() -> None:
        shared_in.wait()
        exclusive_waiting.set()
        with held(exclusive=True):
            events.append("exclusive in")
            time.sleep(0.2)
            events.append("exclusive out")

    threads = [
        threading.Thread(target=shared, args=("first", 0.4)),
        threading.Thread(target=exclusive),
        threading.Thread(target=shared, args=("later", 0.0, exclusive_waiting)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert events == ["first in", "first out", "exclusive in", "exclusive out", "later in", "later out"]


def test_two_shared_holders_run_together(monkeypatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", uuid.uuid4().hex)
    inside = threading.Barrier(2, timeout=5)  # broken (an error) unless both are inside at once

    def shared() -> None:
        with held(exclusive=False):
            inside.wait()

    threads = [threading.Thread(target=shared) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert not inside.broken


def test_without_xdist_the_lock_is_not_taken(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with held(exclusive=True), held(exclusive=True):  # would deadlock if it locked
        pass
    assert list(tmp_path.iterdir()) == []


@dataclass
class FakeItem:
    nodeid: str
    fixturenames: tuple[str, ...] = ()
    marks: list[pytest.Mark] = field(default_factory=list)

    def add_marker(self, marker: pytest.MarkDecorator) -> None:
        self.marks.append(marker.mark)

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return next((m for m in self.marks if m.name == name), None)


def test_the_tests_reading_the_timed_shared_run_are_exclusive() -> None:
    items = [
        FakeItem("tests/dist/test_a.py::test_plain", ("tmp_path",)),
        FakeItem("tests/dist/test_b.py::test_reads_the_run", ("tmp_path", SHARED_TIMED_RUN)),
    ]
    mark_exclusive_users_of_timed_runs(items)  # type: ignore[arg-type]
    assert [[m.name for m in item.marks] for item in items] == [[], ["exclusive"]]


def test_files_that_launch_runs_go_first_heaviest_first_each_in_its_own_order() -> None:
    def item(nodeid: str, *marks: str) -> FakeItem:
        return FakeItem(nodeid, marks=[getattr(pytest.mark, m).mark for m in marks])

    items = [
        item("tests/configs/test_a.py::test_1"),
        item("tests/dist/test_b.py::test_1", "dist"),
        item("tests/dist/test_b.py::test_2", "dist"),
        item("tests/dist/test_c.py::test_1", "dist", "slow"),
        item("tests/dist/test_c.py::test_2", "dist", "slow"),
        item("tests/slurm/test_d.py::test_1", "slurm", "slow"),
        item("tests/unit/test_e.py::test_1"),
        item("tests/dist/test_b.py::test_3", "dist"),
    ]
    heaviest_files_first(items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        "tests/slurm/test_d.py::test_1",  # 25 s
        "tests/dist/test_b.py::test_1",  # 3 x 8 s
        "tests/dist/test_b.py::test_2",
        "tests/dist/test_b.py::test_3",
        "tests/dist/test_c.py::test_1",  # 2 x 12 s: a tie with test_b, by path
        "tests/dist/test_c.py::test_2",
        "tests/configs/test_a.py::test_1",  # no launches: last, in their own order
        "tests/unit/test_e.py::test_1",
    ]
