"""The suite's own scheduling under pytest-xdist (tests/scheduling.py): timed tests alone."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest

from tests.scheduling import Exclusivity, WorkerLock, held, order_files


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


def test_a_timed_runs_readers_are_exclusive_until_one_of_them_has_launched_it() -> None:
    def item(nodeid: str, *fixtures: str) -> FakeItem:
        return FakeItem(nodeid, ("tmp_path", *fixtures))

    plain = item("tests/dist/test_a.py::test_plain")
    marked = FakeItem("tests/dist/test_a.py::test_timed", marks=[pytest.mark.exclusive.mark])
    session = [item(f"tests/dist/test_b.py::test_{n}", "sleepy_rank_run") for n in (1, 2)]
    module = [item("tests/dist/test_c.py::test_1", "text_run"), item("tests/dist/test_d.py::test_1", "text_run")]
    exclusivity = Exclusivity()
    assert [exclusivity.needs(i) for i in (plain, marked, *session, *module)] == [False, True, True, True, True, True]
    exclusivity.ran(session[0])
    exclusivity.ran(module[0])
    exclusivity.ran(marked)
    # The session run serves every file; a module-scoped one is launched again by another file's first reader.
    assert [exclusivity.needs(i) for i in (plain, marked, *session, *module)] == [
        False,
        True,
        False,
        False,
        False,
        True,
    ]


def test_a_worker_keeps_the_exclusive_lock_between_exclusive_tests_and_lets_the_other_in_after(monkeypatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", uuid.uuid4().hex)
    events: list[str] = []
    first_done, other_waiting = threading.Event(), threading.Event()

    def worker() -> None:
        lock = WorkerLock()
        lock.take(exclusive=True)
        events.append("exclusive 1")
        first_done.set()
        other_waiting.wait(timeout=5)
        time.sleep(0.2)  # the other worker is queued for its shared test by now
        lock.take(exclusive=True)  # still held: the other worker's test does not slip in between
        events.append("exclusive 2")
        lock.take(exclusive=False)  # a shared test of this worker: the exclusive hold ends first
        events.append("shared mine")
        lock.release()

    def other() -> None:
        first_done.wait(timeout=5)
        other_waiting.set()
        with held(exclusive=False):
            events.append("shared other")

    threads = [threading.Thread(target=worker), threading.Thread(target=other)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert events[:2] == ["exclusive 1", "exclusive 2"]
    assert sorted(events[2:]) == ["shared mine", "shared other"]


def test_exclusive_files_go_first_then_files_that_launch_runs_heaviest_first_each_in_its_own_order() -> None:
    def item(nodeid: str, *marks: str, fixtures: tuple[str, ...] = ()) -> FakeItem:
        return FakeItem(nodeid, fixtures, marks=[getattr(pytest.mark, m).mark for m in marks])

    items = [
        item("tests/configs/test_a.py::test_1"),
        item("tests/dist/test_b.py::test_1", "dist"),
        item("tests/dist/test_b.py::test_2", "dist"),
        item("tests/dist/test_c.py::test_1", "dist", "slow"),
        item("tests/dist/test_c.py::test_2", "dist", "slow"),
        item("tests/slurm/test_d.py::test_1", "slurm", "slow"),
        item("tests/unit/test_e.py::test_1"),
        item("tests/dist/test_b.py::test_3", "dist"),
        item("tests/unit/test_f.py::test_1", "exclusive"),
        item("tests/dist/test_g.py::test_1", "dist"),
        item("tests/dist/test_g.py::test_2", "dist", fixtures=("sleepy_rank_run",)),
    ]
    order_files(items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        "tests/dist/test_g.py::test_1",  # holds a timed run's reader: first, the heavier of the two
        "tests/dist/test_g.py::test_2",
        "tests/unit/test_f.py::test_1",  # holds an exclusive test
        "tests/slurm/test_d.py::test_1",  # 25 s
        "tests/dist/test_b.py::test_1",  # 3 x 8 s
        "tests/dist/test_b.py::test_2",
        "tests/dist/test_b.py::test_3",
        "tests/dist/test_c.py::test_1",  # 2 x 12 s: a tie with test_b, by path
        "tests/dist/test_c.py::test_2",
        "tests/configs/test_a.py::test_1",  # no launches: last, in their own order
        "tests/unit/test_e.py::test_1",
    ]
