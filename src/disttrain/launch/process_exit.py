"""End a training process with its exit code, skipping the interpreter's teardown of C++ objects.

FSDP2 and DTensor keep their process groups reachable through reference cycles that pass through autograd's
C++ hooks, which Python's garbage collector cannot see. ``destroy_process_group`` therefore leaves gloo's
worker threads running, and tearing the interpreter and the C++ runtime down around them occasionally aborts a
process whose run had finished and written everything ("terminate called without an active exception",
exit -6): a completed run reported as a dead rank. Once the entry point has returned, everything the process
owes is flushed here (exit handlers, non-daemon threads, logs, stdio) and the process ends with ``os._exit``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

SIGINT_EXIT_CODE = 130  # what a shell reports for a process ended by Ctrl-C (128 + SIGINT)


def exit_code_of(stop: SystemExit) -> int:
    """The status ``sys.exit(value)`` would give: None -> 0, an int as is, anything else printed and 1."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1


def run_then_exit(entry_point: Callable[[], object]) -> NoReturn:
    """Run ``entry_point`` and end the process with the status Python itself would have given it."""
    try:
        entry_point()
        code = 0
    except SystemExit as stop:
        code = exit_code_of(stop)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = SIGINT_EXIT_CODE
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    finish_and_exit(code)


def finish_and_exit(code: int) -> NoReturn:
    """Do what a normal interpreter exit does for the program's own state, then end without C++ teardown."""
    try:
        # The interpreter's own first step at exit: wake idle thread pools (torch.compile's, a logger's), then
        # wait for every non-daemon thread. Joining them without the wake-up waits forever on an idle pool.
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()  # logging's flush and close, wandb, multiprocessing children
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing to deliver to
                stream.flush()
        os._exit(code)
