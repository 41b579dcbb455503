"""Elastic restarts for local launches: ``trainer.max_restarts=N`` (torchrun's ``--max-restarts``).

Rank 0 is itself a training process, so it cannot restart a job it is part of (it may be the rank that died).
With restarts configured, the ``python -m train`` process becomes a supervisor that trains nothing: it runs the
job as a child process tree in its own session (rank 0 plus the ranks it spawns, exactly the unsupervised
launch), and when that tree fails it kills whatever is left of it and launches it again in the same run
directory. A restarted attempt resumes from the newest complete checkpoint there (``run.py``).

Under torchrun the attempt number comes from ``TORCHELASTIC_RESTART_COUNT`` and the same resume rule applies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from disttrain.launch.env import ATTEMPT_ENV, PARENT_PID_ENV, say
from disttrain.launch.exit_codes import NOT_RESTARTABLE
from disttrain.launch.local import describe_exit, rerun_command


def attempt_command(module: str, task_overrides: Sequence[str], run_dir: Path, attempt: int) -> list[str]:
    """This job again, in the same run dir; Hydra's record (.hydra/) stays the supervisor's."""
    return rerun_command(module, task_overrides, run_dir, f"train_attempt{attempt}")


def kill_session(pid: int) -> None:
    """SIGKILL every process of the attempt's session (it leads its own): no rank survives its job."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def supervise(module: str, task_overrides: Sequence[str], run_dir: Path, max_restarts: int, cwd: str) -> int:
    """Run the job, relaunching it up to ``max_restarts`` times after a failure; returns the final exit code."""
    current: list[subprocess.Popen] = []

    def forward(signum: int, frame: object) -> None:
        # Stopping the supervisor stops the job: nothing may keep training (or holding GPUs) without it.
        for proc in current:
            kill_session(proc.pid)
        sys.exit(128 + signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    code = 1
    try:
        for attempt in range(max_restarts + 1):
            env = {**os.environ, ATTEMPT_ENV: str(attempt), PARENT_PID_ENV: str(os.getpid())}
            env.pop("LOCAL_RANK", None)
            cmd = attempt_command(module, task_overrides, run_dir, attempt)
            proc = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True)
            current[:] = [proc]
            code = proc.wait()
            kill_session(proc.pid)
            if code == 0:
                return 0
            if code in NOT_RESTARTABLE:
                say(f"disttrain: the job failed with exit code {code}, which a restart would repeat; not restarting")
                return code
            if attempt < max_restarts:
                say(
                    f"disttrain: attempt {attempt} failed ({describe_exit(code)}); restart {attempt + 1} of "
                    f"{max_restarts}, resuming from the newest complete checkpoint in {run_dir / 'checkpoints'}",
                    file=sys.stderr,
                )
        say(f"disttrain: giving up after {max_restarts} restart(s) (trainer.max_restarts)", file=sys.stderr)
        return code if code > 0 else 128 - code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
