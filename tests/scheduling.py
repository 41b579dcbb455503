"""How the suite shares this machine's cores between two pytest-xdist workers without bending what it measures.

Half of the suite's wall time is single-core: a launch's Hydra compose and imports before its ranks start, its
report and teardown after, the hang watchdogs' timeouts, the unit tests. Two workers (``-n auto``, at most 2 here:
``pytest_xdist_auto_num_workers``) fill those gaps with another test. Two rules keep that honest:

- **Files**: a test file runs whole on one worker (``--dist loadfile``), so a module's shared launches run once (xdist's
  ``loadgroup`` would be finer, but with pytest 9 it no longer sees the groups: xdist 3.8 renames ``_nodeid``). (A
  session fixture read by several files, such as the straggler run ``sleepy_rank_run`` if another file read it,
  is launched by each worker that gets one of them.)
- **Exclusive files, then longest first**: files holding an exclusive test go first (below), then the files that
  launch runs, heaviest first (a weight per test from its marks), and the many quick unit and config tests last,
  where they fill whichever worker finishes first (xdist's own order, most tests first, put them first and left one
  worker alone with the SLURM tests at the end).
- **Exclusive tests**: a test marked ``exclusive`` reads wall-clock time (a diagnosis of where a run's time goes, a
  logged rate compared window by window, an upper bound on a timed part): it runs alone. Every test holds a shared
  lock for its whole protocol (setup, call, teardown) and an exclusive test the exclusive one; a turnstile taken
  before either keeps an exclusive test from waiting behind an endless stream of shared ones. A test that reads a
  timed run launched by a fixture (``TIMED_RUNS``) is exclusive only while that run is still to be launched: the
  first reader launches it alone, the others only read its files. A worker keeps the exclusive lock from one
  exclusive test to the next, and the exclusive tests come first: an exclusive test waits for whatever the other
  worker is running (the suite's timeline, ``DISTTRAIN_SUITE_TIMELINE``, measured 134 s of 1012 spent so, most
  of it behind a long launch of the other worker), so it should wait as rarely as it can, and at the start, when
  the other worker is in an exclusive file too.

Without xdist (``-n 0``, or a plain ``pytest FILE``) nothing here does anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Fixtures that launch a run whose timing their users read (tests/dist/conftest.py, tests/dist/test_runs.py), with
# their scope: the first user of one on a worker launches it and runs alone.
TIMED_RUNS = {"sleepy_rank_run": "session", "text_run": "module"}
# Where each test's protocol is appended as a JSON line when set (its worker, when it asked for the suite lock, got
# it and ended): how long workers sat idle waiting for an exclusive test's turn (benchmarks/suite_timeline.py reads it).
TIMELINE_ENV = "DISTTRAIN_SUITE_TIMELINE"
MAX_WORKERS = 2  # dist tests start 2-4 processes each: more workers than this thrash a small box


def xdist_run_id() -> str | None:
    """The id pytest-xdist gives every worker of one run (None: not under xdist)."""
    return os.environ.get("PYTEST_XDIST_TESTRUNUID")


@contextlib.contextmanager
def held(exclusive: bool) -> Iterator[None]:
    """The suite lock, shared or exclusive, for as long as the block runs (a no-op outside xdist)."""
    run_id = xdist_run_id()
    if run_id is None:
        yield
        return
    base = Path(tempfile.gettempdir()) / f"disttrain-pytest-{run_id}"
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def timed_run_keys(item: pytest.Item) -> list[tuple[str, str]]:
    """The timed runs ``item`` reads, each named as its fixture's cache is: by name (session) or name and file."""
    return [
        (name, "" if TIMED_RUNS[name] == "session" else file_of(item))
        for name in getattr(item, "fixturenames", ())
        if name in TIMED_RUNS
    ]


class Exclusivity:
    """Which tests must run alone: those marked ``exclusive``, and a timed run's readers until it is launched."""

    def __init__(self) -> None:
        self.launched: set[tuple[str, str]] = set()

    def needs(self, item: pytest.Item) -> bool:
        return marked_exclusive(item) or any(key not in self.launched for key in timed_run_keys(item))

    def ran(self, item: pytest.Item) -> None:
        """``item``'s protocol ended: the timed runs it read are launched (or failed, which its readers report)."""
        self.launched.update(timed_run_keys(item))


def marked_exclusive(item: pytest.Item) -> bool:
    return item.get_closest_marker("exclusive") is not None


def holds_exclusive(item: pytest.Item) -> bool:
    """Whether ``item`` may run alone (marked, or a reader of a timed run): known at collection, for the order."""
    return marked_exclusive(item) or bool(timed_run_keys(item))


class WorkerLock:
    """This worker's hold on the suite lock, kept from one exclusive test to the next (no other test between)."""

    def __init__(self) -> None:
        self._hold: contextlib.ExitStack | None = None
        self._exclusive = False

    def take(self, exclusive: bool) -> None:
        if self._hold is not None and self._exclusive and exclusive:
            return
        self.release()
        hold = contextlib.ExitStack()
        hold.enter_context(held(exclusive))
        self._hold, self._exclusive = hold, exclusive

    def release(self) -> None:
        if self._hold is not None:
            self._hold.close()
            self._hold = None


# Rough seconds per test by its marks (measured: a launch is 8-12 s, a SLURM job ~25 s; unit tests milliseconds):
# only the order of files depends on them.
MARK_SECONDS = {"slurm": 25.0, "slow": 12.0, "dist": 8.0}


def weight(item: pytest.Item) -> float:
    return max((seconds for mark, seconds in MARK_SECONDS.items() if item.get_closest_marker(mark)), default=0.0)


def order_files(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: files holding an exclusive test first, then by their summed weight, heaviest
    first (ties by path), each file's tests in their own order. Deterministic, as xdist needs every worker to
    collect the same order."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(file_of(item), []).append(item)

    def key(name: str) -> tuple[bool, float, str]:
        tests = files[name]
        return (not any(holds_exclusive(i) for i in tests), -sum(weight(i) for i in tests), name)

    order = sorted(files, key=key)
    items[:] = [item for f in order for item in files[f]]


def file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def auto_workers() -> int:
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


def record_timeline(nodeid: str, exclusive: bool, asked: float, started: float, ended: float) -> None:
    """One line per test protocol in ``$DISTTRAIN_SUITE_TIMELINE`` (nothing when unset); ``time.monotonic`` clocks,
    shared by the workers of one machine."""
    path = os.environ.get(TIMELINE_ENV)
    if not path:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    line = {
        "worker": worker,
        "test": nodeid,
        "exclusive": exclusive,
        "asked": asked,
        "started": started,
        "ended": ended,
    }
    with open(path, "a") as out:  # one short write per line: appends from two workers do not interleave
        out.write(json.dumps(line) + "\n")
