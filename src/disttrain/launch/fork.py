"""Local ranks forked from rank 0 once it has imported torch and Lightning, instead of started as new interpreters.

A rank started as ``python -m train ...`` spends seconds of CPU importing torch, torch._dynamo, Lightning and
torchmetrics before it does anything; a forked one inherits them. On a CPU box that runs several ranks on a few
cores that is the largest part of a short run's CPU (figures: benchmarks/RESULTS.md, "Test suite time"). The forked
rank then runs exactly what the new interpreter would: the same module as ``__main__`` with the same arguments and
environment, in the same working directory.

Forking is only safe where no native thread pool exists yet that does not survive a fork: libgomp's (torch's
first parallel CPU op starts it; in the child the next parallel op then waits forever for its lost threads) or
HF tokenizers' (rayon). So a job forks its ranks only if its process had not imported torch or tokenizers before
it imported what the ranks run (``pools_untouched``, asked before that import: the checks of the command import
neither), and only while it has no other Python thread; else, and for GPU jobs (CUDA cannot be used in a child
forked after the parent touched it), each rank is a new interpreter. OpenBLAS's threads (numpy) are fork-safe.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

from disttrain.launch.process_exit import run_then_exit

# Libraries whose native thread pool is lost in a forked child (see above); importing one does not start its pool.
FORK_UNSAFE_POOLS = ("torch", "tokenizers")


def pools_untouched() -> bool:
    """Whether this process has imported none of ``FORK_UNSAFE_POOLS`` yet (so none of their pools can exist)."""
    return not any(name in sys.modules for name in FORK_UNSAFE_POOLS)


class ForkedProcess:
    """A forked child with the part of ``subprocess.Popen``'s interface the launcher uses (poll, wait, kill,
    returncode: negative for a signal, as Popen reports it). Safe to poll from a watcher thread and wait from the
    main thread at once (only one of them reaps the child)."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): Popen reports 0 then too
                    pid, status = self.pid, 0
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def fork_module(
    command: Sequence[str], env: dict[str, str], cwd: str, reset: Callable[[], None]
) -> ForkedProcess | None:
    """Run ``command`` (``[sys.executable, "-m", module, *args]``) in a child forked from this process; None when
    this process has another Python thread (missing in the child, with whatever locks it held). ``reset`` runs
    first in the child: it clears what this process's own job left in module state that a new interpreter would
    not have (e.g. Hydra's global config)."""
    if len(command) < 3 or command[0] != sys.executable or command[1] != "-m" or threading.active_count() > 1:
        return None
    for stream in (sys.stdout, sys.stderr):  # else the child writes this process's buffered output again
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    pid = os.fork()
    if pid:
        return ForkedProcess(pid, command)
    _run_as_main(command[2], list(command[3:]), env, cwd, reset)


def _run_as_main(module: str, args: list[str], env: dict[str, str], cwd: str, reset: Callable[[], None]) -> NoReturn:
    """In the forked child: become ``python -m module args`` and never return into the parent's stack (the module's
    own exit ends the process; an error before it ends it as ``run_then_exit`` ends any other)."""

    def become() -> None:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        reset()
        sys.argv = [module, *args]  # run_module puts the module's path in argv[0], as ``python -m`` does
        runpy.run_module(module, run_name="__main__", alter_sys=True)

    run_then_exit(become)
