"""Start the local ranks of a single-node run as child processes of rank 0.

Lightning can launch children itself, but under Hydra it re-runs the original ``sys.argv``: in a multirun
(``-m a=1,2``) every child would start a whole sweep of its own. Here each child re-runs exactly this job's
resolved overrides in this job's run directory. Once ``LOCAL_RANK``/``WORLD_SIZE`` are in the environment,
Lightning treats the processes as externally created and only joins them into a process group.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrain.launch.env import CHILD_ENV_FLAG, PARENT_PID_ENV
from disttrain.launch.fork import ForkedProcess, fork_module

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def describe_exit(code: int) -> str:
    """``-9`` -> 'killed by SIGKILL', ``1`` -> 'exit code 1' (Popen reports a signal as a negative code)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class _ParentWatch:
    """What ``die_with_parent`` watches: the parent's pidfd (None: it was gone already; -1: no pidfd, poll) and what
    to do once it has died, done once by whichever thread sees the death first."""

    parent: int
    pidfd: int | None
    on_death: Callable[[int], None] | None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wait(self, timeout_s: float | None) -> bool:
        """Whether the parent died within ``timeout_s`` (None: wait for as long as it lives)."""
        if self.pidfd is not None and self.pidfd >= 0:
            return bool(select.select([self.pidfd], [], [], timeout_s)[0])
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while os.getppid() == self.parent:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.1 if deadline is not None else 1.0)
        return True

    def record_death_and_exit(self) -> None:
        """Run ``on_death`` (once for this process: the other thread waits here until it is done), then exit."""
        with self.lock:
            try:
                if self.on_death is not None:
                    on_death, self.on_death = self.on_death, None
                    on_death(self.parent)
            finally:
                os._exit(1)


_parent_watch: list[_ParentWatch] = []  # set by die_with_parent in a spawned rank that records its parent's death


def die_with_parent(on_parent_death: Callable[[int], None] | None = None) -> None:
    """In a process spawned by disttrain: exit when the spawning process dies, even by SIGKILL.

    Otherwise a killed rank 0 leaves its children waiting in a collective for the 30-minute gloo/NCCL
    timeout, holding memory and GPUs. Without ``on_parent_death`` Linux sends us SIGKILL when the parent dies
    (PR_SET_PDEATHSIG); elsewhere a thread polls the parent pid.

    ``on_parent_death(parent_pid)``: what to do first (record the death: the parent cannot any more). A thread
    then waits on the parent's pidfd (Linux 5.3+; no cost while it lives), calls it when the parent has died and
    ends this process; ``await_parent_death`` lets this process's own exit wait for that.
    """
    parent = int(os.environ.get(PARENT_PID_ENV) or 0)
    if not parent:
        return
    if on_parent_death is None and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # it died before the request above took effect
            os._exit(1)
        return
    try:
        pidfd: int | None = os.pidfd_open(parent)  # type: ignore[attr-defined]
    except ProcessLookupError:
        pidfd = None  # gone already
    except (AttributeError, OSError):
        pidfd = -1  # no pidfd here: poll
    watch = _ParentWatch(parent, pidfd, on_parent_death)
    _parent_watch[:] = [watch]

    def wait_then_record() -> None:
        if pidfd is not None:
            watch.wait(None)
        watch.record_death_and_exit()

    threading.Thread(target=wait_then_record, name="disttrain-parent-watch", daemon=True).start()


def await_parent_death(timeout_s: float) -> None:
    """In a spawned rank about to exit after an error: if the parent died (or dies within ``timeout_s``: its
    sockets can close a moment before its exit is visible), record its death here and end this process; returns
    at once where no death is watched, and after ``timeout_s`` while the parent lives."""
    if not _parent_watch:
        return
    watch = _parent_watch[0]
    if watch.pidfd is None or watch.wait(timeout_s):
        watch.record_death_and_exit()  # whichever of this thread and the watcher comes first records it


def exit_status_of_dead_process(pid: int, wait_s: float = 0.5) -> int | None:
    """How a process that is dying ended, as Popen reports it (``-9``: SIGKILL), read while it is a zombie its own
    parent has not reaped yet (Linux, ``/proc/PID/stat`` field 52); None when that cannot be read (any more)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            state, status = fields[0], int(fields[49])  # the fields after "(comm)" start at field 3
        except (OSError, IndexError, ValueError):
            return None  # reaped already (or no /proc)
        if state in ("Z", "X"):
            return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF
        if time.monotonic() >= deadline:
            return None  # still exiting, or the pid was reused
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rerun_command(module: str, task_overrides: Sequence[str], run_dir: str | Path, job_name: str) -> list[str]:
    """This Hydra job again, in the same run directory, logging to ``<job_name>.log``; Hydra's ``.hydra/``
    record stays the original process's."""
    return [sys.executable, "-m", module, *task_overrides, f"hydra.run.dir={run_dir}", *secondary_job(job_name)]


def secondary_job(job_name: str) -> list[str]:
    """Hydra overrides of a process that joins a job as another rank or attempt: it logs to ``<job_name>.log`` and
    leaves the ``.hydra/`` record to the job's first process."""
    return ["hydra.output_subdir=null", f"hydra.job.name={job_name}"]


def rank_overrides(hydra_cfg: Any) -> list[str]:
    """The overrides another rank or attempt of this Hydra job is started with: the task's, and a config dir of the
    user's own (``hydra.searchpath``, where their ``model/<name>.yaml`` lives), which Hydra keeps among its own."""
    searchpath = [o for o in hydra_cfg.overrides.hydra if o.lstrip("+").startswith("hydra.searchpath=")]
    return [*hydra_cfg.overrides.task, *searchpath]


def child_command(module: str, task_overrides: Sequence[str], run_dir: str, local_rank: int) -> list[str]:
    """The command that re-runs this Hydra job as another local rank (its log: ``train_rank<N>.log``)."""
    return rerun_command(module, task_overrides, run_dir, f"train_rank{local_rank}")


@dataclass
class LocalRanks:
    """Children for local ranks 1..n-1; rank 0 is the calling process."""

    procs: list[subprocess.Popen | ForkedProcess] = field(default_factory=list)
    failed: list[tuple[int, int]] = field(default_factory=list)  # (local rank, exit code)
    # Whether a child's non-zero exit is an agreed stop (every rank stops, the launcher completes it), not a death.
    agreed_stop: Callable[[int, int], bool] = lambda rank, code: False
    stopped: list[tuple[int, int]] = field(default_factory=list)  # (local rank, exit code) of agreed stops
    saved_env: dict[str, str | None] = field(default_factory=dict)
    rank_zero_env: dict[str, str] = field(default_factory=dict)  # what become_rank_zero sets in this process
    _stop: threading.Event = field(default_factory=threading.Event)

    def become_rank_zero(self) -> None:
        """Make this process local rank 0 of the job (the environment Lightning reads); ``restore_env`` undoes it."""
        self.saved_env = {key: os.environ.get(key) for key in self.rank_zero_env}
        os.environ.update(self.rank_zero_env)

    def restore_env(self) -> None:
        """Undo the rank-0 environment, so the next job of a Hydra multirun in this process starts clean."""
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self.saved_env = {}

    def watch(self, on_failure: Callable[[int, int], None], period_s: float = 1.0) -> None:
        """Call ``on_failure`` from a daemon thread as soon as any child exits non-zero (an agreed stop aside)."""

        def loop() -> None:
            while not self._stop.is_set():
                for rank, proc in enumerate(self.procs, start=1):
                    code = proc.poll()
                    if code in (None, 0) or (rank, code) in self.failed or (rank, code) in self.stopped:
                        continue
                    if self.agreed_stop(rank, code):
                        self.stopped.append((rank, code))  # this process is on its way to the same stop
                        continue
                    self.failed.append((rank, code))
                    on_failure(rank, code)
                    return
                time.sleep(period_s)

        threading.Thread(target=loop, name="disttrain-rank-watch", daemon=True).start()

    def dead(self, wait_s: float) -> list[tuple[int, int]]:
        """Children that exited non-zero, an agreed stop aside, waiting up to ``wait_s`` for one (an exit is seen
        only once reaped)."""
        deadline = time.monotonic() + wait_s
        while True:
            codes = [(rank, p.poll()) for rank, p in enumerate(self.procs, start=1)]
            found = [(rank, code) for rank, code in codes if code and not self.agreed_stop(rank, code)]
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.1)

    def stop_watching(self) -> None:
        self._stop.set()

    def wait(self, timeout_s: float = 120.0) -> list[tuple[int, int]]:
        """Wait for every child; kill the ones still alive after ``timeout_s``. Returns (rank, code) failures."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for rank, proc in enumerate(self.procs, start=1):
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            if code != 0 and (rank, code) not in self.failed:
                self.failed.append((rank, code))
        self.restore_env()
        return self.failed

    def kill(self) -> None:
        self._stop.set()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
        self.restore_env()


def spawn_local_ranks(num_processes: int, command_for_rank: Callable[[int], list[str]], cwd: str) -> LocalRanks:
    """Set this process up as local rank 0 of ``num_processes`` and start the others with ``command``."""
    ranks = start_local_ranks(num_processes, command_for_rank, cwd)
    ranks.become_rank_zero()
    return ranks


def start_local_ranks(
    num_processes: int,
    command_for_rank: Callable[[int], list[str]],
    cwd: str,
    fork_reset: Callable[[], None] | None = None,
) -> LocalRanks:
    """Start local ranks 1..n-1 and leave this process's environment as it is until ``become_rank_zero``.

    Split from ``spawn_local_ranks`` so that rank 0 can start its children as soon as the job is checked, and they
    import torch/Lightning while it does (``job/launcher.py``); its own role (``process_role``) must not change
    before it reaches the point where it joins the job as rank 0 (``NODE_RANK`` would make it a cluster task).
    ``fork_reset``: fork the ranks from this process (it has imported what they need: launch/fork.py) where it
    safely can, running this first in each; a new interpreter otherwise."""
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),  # a fresh port per job: the previous job's store may linger
        "NODE_RANK": "0",
        "WORLD_SIZE": str(num_processes),
        "LOCAL_RANK": "0",
    }
    ranks = LocalRanks(rank_zero_env=env)
    for local_rank in range(1, num_processes):
        child_env = {
            **os.environ,
            **env,
            "LOCAL_RANK": str(local_rank),
            CHILD_ENV_FLAG: str(local_rank),
            PARENT_PID_ENV: str(os.getpid()),
        }
        command = command_for_rank(local_rank)
        forked = fork_module(command, child_env, cwd, fork_reset) if fork_reset is not None else None
        ranks.procs.append(forked or subprocess.Popen(command, env=child_env, cwd=cwd))
    return ranks
