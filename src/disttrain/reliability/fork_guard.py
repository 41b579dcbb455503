"""DataLoader workers that cannot hang inside their fork on the Pythons where CPython's fork can deadlock.

CPython before 3.12 (and before 3.11.10, 3.10.15, 3.9.20, 3.8.20) reinitialises the interpreter's thread-state
lock in a forked child only after it has already taken it (gh-112275). A fork taken while another thread holds that
lock gives a child that waits on it forever, before it runs a line of Python. In a training rank a native thread holds
it, briefly, each time it enters Python without a thread state of its own: gloo's work threads do so each time they
drop the last reference to a tensor Python has let go of (``ProcessGroupGloo::AsyncWork::~AsyncWork`` ->
``decref_pyobject`` -> ``PyThreadState_New``), right after a collective, e.g. the one Lightning runs just before it
forks the DataLoader workers. The rank then waits for a batch that never comes (seen in CI: the worker's stack ended
in ``PyOS_AfterFork_Child -> _PyThreadState_DeleteExcept -> PyThread_acquire_lock``).

Two defences, both only on an affected Python:
- ``ConfirmedForkContext``: a fork start method whose child confirms it got past the fork (its first Python line
  in the new process); a child silent for ``confirm_timeout_s`` is killed (it has run nothing of the user's) and
  forked again. The strategies put it on every DataLoader that forks its workers (``guard_dataloader``).
- ``install_fork_barrier``: before any fork of the process, wait until no thread holds the lock (a preempted holder
  is the common case on a loaded host). It narrows the window for forks the first cannot see (a user's own pool);
  it cannot close it: a native thread may take the lock between the barrier and the fork.
Figures: benchmarks/fork_deadlock.py.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import sys
from multiprocessing import context as mp_context
from multiprocessing import popen_fork
from typing import Any

from disttrain.launch.env import say

# The first patch release of each minor that reinitialises the lock before use (gh-112275); 3.12 has it from .0.
FIRST_FIXED_PATCH = {(3, 8): 20, (3, 9): 20, (3, 10): 15, (3, 11): 10}
CONFIRM_TIMEOUT_S = 10.0
ATTEMPTS = 3
_CONFIRMED = b"1"


def fork_can_deadlock(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    """Whether this CPython's fork can hang the child on a lock another thread held (gh-112275)."""
    major_minor = (version[0], version[1])
    if major_minor >= (3, 12):
        return False
    return version[2] < FIRST_FIXED_PATCH.get(major_minor, sys.maxsize)


def settle_thread_states() -> None:
    """Return once no thread holds the interpreter's thread-state lock: ``sys._current_frames`` takes it (with the
    GIL held, which its holders never need, so this cannot deadlock)."""
    sys._current_frames()


_barrier_installed = False


def install_fork_barrier() -> None:
    """Run ``settle_thread_states`` before every fork of this process (once per process; affected Pythons only)."""
    global _barrier_installed
    if _barrier_installed or not fork_can_deadlock():
        return
    os.register_at_fork(before=settle_thread_states)
    _barrier_installed = True


class ForkNeverConfirmed(RuntimeError):
    """Every attempt to fork a worker gave a child that never started."""


def _wait_for_confirmation(fd: int, timeout_s: float) -> bool:
    """True once the child confirmed or died (EOF: its failure is the process's own, reported as usual); False if
    it stayed silent for ``timeout_s`` (``select`` resumes after a signal with the time left, PEP 475)."""
    readable, _, _ = select.select([fd], [], [], timeout_s)
    return bool(readable)


class _ConfirmedForkPopen(popen_fork.Popen):
    confirm_timeout_s = CONFIRM_TIMEOUT_S
    attempts = ATTEMPTS
    reforked = 0  # children killed silent in this process (read by benchmarks/fork_deadlock.py)

    def _launch(self, process_obj: Any) -> None:
        for _ in range(self.attempts):
            read_fd, write_fd = os.pipe()
            process_obj._confirm_fds = (read_fd, write_fd)
            try:
                super()._launch(process_obj)  # type: ignore[misc]  # the child never returns from it
            finally:
                os.close(write_fd)
                process_obj._confirm_fds = None
            try:
                if _wait_for_confirmation(read_fd, self.confirm_timeout_s):
                    return
            finally:
                os.close(read_fd)
            # Stuck inside its fork: nothing of the user's ran in it, so killing it and forking again is safe.
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            if self.finalizer is not None:
                self.finalizer()
            if _ConfirmedForkPopen.reforked == 0:
                say(
                    f"warning: a DataLoader worker hung inside its fork (CPython gh-112275, Python "
                    f"{sys.version.split()[0]}); killed after {self.confirm_timeout_s:.0f} s and forked again. "
                    "Python >= 3.11.10 does not have the bug.",
                    file=sys.stderr,
                )
            _ConfirmedForkPopen.reforked += 1
        raise ForkNeverConfirmed(
            f"{self.attempts} forked workers in a row never started (each silent for {self.confirm_timeout_s:.0f} s "
            "after its fork): CPython's fork deadlock gh-112275. Fix: run on Python >= 3.11.10 (or 3.12), or give "
            "the DataLoader multiprocessing_context='forkserver'."
        )


class _ConfirmedForkProcess(mp_context.ForkProcess):
    _confirm_fds: tuple[int, int] | None = None

    @staticmethod
    def _Popen(process_obj: Any) -> _ConfirmedForkPopen:
        return _ConfirmedForkPopen(process_obj)

    def _bootstrap(self, parent_sentinel: Any = None) -> int:
        # The child's first Python: it got past the fork's lock handling.
        if self._confirm_fds is not None:
            read_fd, write_fd = self._confirm_fds
            os.close(read_fd)
            os.write(write_fd, _CONFIRMED)
            os.close(write_fd)
        return super()._bootstrap(parent_sentinel)  # type: ignore[misc]


class ConfirmedForkContext(mp_context.ForkContext):
    """The fork start method, each child confirming it started (module docstring)."""

    Process = _ConfirmedForkProcess


CONFIRMED_FORK = ConfirmedForkContext()


def default_start_method() -> str:
    """The start method a loader without its own uses, without fixing it (``get_start_method()`` would: a user's
    later ``set_start_method`` would then fail)."""
    chosen = multiprocessing.get_start_method(allow_none=True)
    return chosen or mp_context._default_context._default_context._name  # type: ignore[attr-defined]


def guard_dataloader(loader: object) -> object:
    """Give ``loader`` the confirmed fork if it would fork its workers on an affected Python; else leave it as is
    (no workers, a start method of its own, or a default start method other than fork)."""
    from torch.utils.data import DataLoader

    if not isinstance(loader, DataLoader) or loader.num_workers == 0 or loader.multiprocessing_context is not None:
        return loader
    if not fork_can_deadlock() or default_start_method() != "fork":
        return loader
    install_fork_barrier()
    loader.multiprocessing_context = CONFIRMED_FORK
    return loader
