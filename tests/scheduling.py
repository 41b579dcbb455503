"""How the suite shares this machine's cores between two pytest-xdist workers without bending what it measures.

Half of the suite's wall time is single-core: a launch's Hydra compose and imports before its ranks start, its
report and teardown after, the hang watchdogs' timeouts, the unit tests. Two workers (``-n auto``, at most 2 here:
``pytest_xdist_auto_num_workers``) fill those gaps with another test. Two rules keep that honest:

- **Files**: a test file runs whole on one worker (``--dist loadfile``), so a module's shared launches run once (xdist's
  ``loadgroup`` would be finer, but with pytest 9 it no longer sees the groups: xdist 3.8 renames ``_nodeid``). (The
  straggler run ``sleepy_rank_run`` is a session fixture of three files: a worker that gets one of them launches
  it for itself.)
- **Longest first**: files that launch runs go first, heaviest first (a weight per test from its marks), and the
  many quick unit and config tests last, where they fill whichever worker finishes first (xdist's own order, most
  tests first, put them first and left one worker alone with the SLURM tests at the end).
- **Exclusive tests**: a test marked ``exclusive`` reads wall-clock time (a diagnosis of where a run's time goes, a
  logged rate compared window by window, an upper bound on a timed part): it runs alone. Every test holds a shared
  lock for its whole protocol (setup, call, teardown) and an exclusive test the exclusive one; a turnstile taken
  before either keeps an exclusive test from waiting behind an endless stream of shared ones.

Without xdist (``-n 0``, or a plain ``pytest FILE``) nothing here does anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# The session fixture whose run is a timed diagnosis (tests/dist/conftest.py): its users run alone.
SHARED_TIMED_RUN = "sleepy_rank_run"
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


def mark_exclusive_users_of_timed_runs(items: list[pytest.Item]) -> None:
    """The tests that read the straggler run are ``exclusive``: the first of them on a worker launches it."""
    for item in items:
        if SHARED_TIMED_RUN in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.exclusive)


# Rough seconds per test by its marks (measured: a launch is 8-12 s, a SLURM job ~25 s; unit tests milliseconds):
# only the order of files depends on them.
MARK_SECONDS = {"slurm": 25.0, "slow": 12.0, "dist": 8.0}


def weight(item: pytest.Item) -> float:
    return max((seconds for mark, seconds in MARK_SECONDS.items() if item.get_closest_marker(mark)), default=0.0)


def heaviest_files_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: files by their summed weight, heaviest first (ties by path), each file's tests in
    their own order. Deterministic, as xdist needs every worker to collect the same order."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(file_of(item), []).append(item)
    order = sorted(files, key=lambda f: (-sum(weight(i) for i in files[f]), f))
    items[:] = [item for f in order for item in files[f]]


def file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def auto_workers() -> int:
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))
