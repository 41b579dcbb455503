"""A spawned rank records its parent's (rank 0's) death once, whichever of its threads sees it first
(launch/local.py: die_with_parent's watcher thread, await_parent_death on the rank's own error path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from disttrain.launch.env import PARENT_PID_ENV
from tests.conftest import REPO

# A stand-in for a spawned rank: watches the pid in PARENT_PID_ENV, records its death by appending a line (slowly,
# so both threads are inside the recording at once), and on its "error path" waits for that death.
RANK = """
import sys, time
from pathlib import Path
from disttrain.launch.local import await_parent_death, die_with_parent
log = Path(sys.argv[1])
def record(parent):
    with log.open("a") as out:
        out.write(f"{parent}\\n")
    time.sleep(0.5)
die_with_parent(record)
print("watching", flush=True)
sys.stdin.readline()  # the test's cue: the parent is dead, or lives on
await_parent_death(timeout_s=float(sys.argv[2]))
print("returned", flush=True)
"""


def start_rank(parent: int, log: Path, wait_s: float) -> subprocess.Popen:
    env = {**os.environ, PARENT_PID_ENV: str(parent), "PYTHONPATH": str(REPO)}
    rank = subprocess.Popen(
        [sys.executable, "-c", RANK, str(log), str(wait_s)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert rank.stdout is not None and rank.stdout.readline() == "watching\n"
    return rank


def test_a_dead_parent_is_recorded_once_and_ends_the_rank(tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    log = tmp_path / "deaths.txt"
    rank = start_rank(parent.pid, log, wait_s=15.0)
    parent.kill()  # not reaped yet, as rank 0 is not while its own parent reads its pipes
    out, _ = rank.communicate("go\n", timeout=30)
    parent.wait()
    assert rank.returncode == 1 and "returned" not in out
    assert log.read_text().splitlines() == [str(parent.pid)]


def test_the_error_path_sees_a_death_that_happened_before_it_looked(tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", "pass"])
    log = tmp_path / "deaths.txt"
    rank = start_rank(parent.pid, log, wait_s=15.0)
    parent.wait()
    out, _ = rank.communicate("go\n", timeout=30)
    assert rank.returncode == 1 and "returned" not in out
    assert log.read_text().splitlines() == [str(parent.pid)]


def test_a_living_parent_lets_the_error_path_go_on_after_the_wait(tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        log = tmp_path / "deaths.txt"
        rank = start_rank(parent.pid, log, wait_s=0.3)
        out, _ = rank.communicate("go\n", timeout=30)
        assert rank.returncode == 0 and out == "returned\n"
        assert not log.exists()
    finally:
        parent.kill()
        parent.wait()
