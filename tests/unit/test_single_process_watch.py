"""A 1-process run ended by a signal is recorded (job/launcher_death.py's watch, job/failure.py's signal stop)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.utilities.exceptions import SIGTERMException

from disttrain.job.failure import interrupting_signal
from tests.conftest import REPO

# A stand-in for a 1-process run: records run.json as running, starts its watcher, then does what argv[2] says.
RUN = """
import sys, time
from pathlib import Path
from diagnostics.manifest import RunManifest
from disttrain.job.launcher_death import stop_watching, watch_this_process
run_dir = Path(sys.argv[1])
RunManifest(config={"diagnostics": {"enabled": False}}).write(run_dir)
watcher = watch_this_process(run_dir)
print("watched", flush=True)
if sys.argv[2] == "ends":  # the job ends by itself (and has recorded how): its watcher goes with it
    stop_watching(watcher)
    print(watcher.returncode, flush=True)
elif sys.argv[2] == "completes":  # recorded its end, then the process exits while its watcher still waits
    RunManifest(status="completed").write(run_dir)
else:
    time.sleep(120)
"""


def start(run_dir: Path, then: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-c", RUN, str(run_dir), then],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_killed_one_process_run_is_recorded_by_its_watcher(tmp_path: Path) -> None:
    proc = start(tmp_path, "sleeps")
    assert proc.stdout.readline() == "watched\n"  # type: ignore[union-attr]
    proc.kill()
    # The watcher holds the pipes until it has recorded the death; the dead process stays unreaped until then.
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert stderr.splitlines() == ["disttrain: rank 0 died (killed by SIGKILL); stopping the job"]
    manifest = json.loads((tmp_path / "run.json").read_text())
    assert (manifest["status"], manifest["failed_rank"], manifest["failure"]) == (
        "failed",
        0,
        "rank 0 died (killed by SIGKILL)",
    )
    assert json.loads((tmp_path / "failure.json").read_text())["error"] == "killed by SIGKILL"


@pytest.mark.parametrize("then", ["ends", "completes"])
def test_a_run_that_ends_by_itself_is_left_as_it_recorded(tmp_path: Path, then: str) -> None:
    proc = start(tmp_path, then)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0 and stderr == ""
    if then == "ends":
        assert stdout.splitlines() == ["watched", str(-signal.SIGKILL)]  # stop_watching ended it
    manifest = json.loads((tmp_path / "run.json").read_text())
    assert manifest["status"] == ("running" if then == "ends" else "completed")
    assert not (tmp_path / "failure.json").exists()


def interrupted_by_ctrl_c() -> SystemExit:
    """What Lightning raises on Ctrl-C: ``sys.exit(1)`` while handling the KeyboardInterrupt."""
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            sys.exit(1)
    except SystemExit as stop:
        return stop


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (SIGTERMException(), signal.SIGTERM),
        (interrupted_by_ctrl_c(), signal.SIGINT),
        (KeyboardInterrupt(), signal.SIGINT),
        (SystemExit(1), None),
        (RuntimeError("boom"), None),
    ],
)
def test_the_signal_behind_an_error_that_ended_fit(error: BaseException, expected: signal.Signals | None) -> None:
    assert interrupting_signal(error) == expected
