"""The local SLURM cluster for tests/slurm: started once per session by ``local_cluster.sh``, stopped after.

Where the cluster cannot be brought up (not root, no apt, no packages reachable) the SLURM tests fail in CI
(``CI`` set) -- a CI that silently skips them would claim a proof it never ran -- and are skipped elsewhere
with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

CLUSTER = REPO / "tests" / "slurm" / "local_cluster.sh"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def cluster_is_up() -> bool:
    if not shutil.which("sinfo"):
        return False
    probe = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30, check=False)
    return probe.returncode == 0 and "idle" in probe.stdout


def cannot_start() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "local_cluster.sh needs root on Linux (it installs Debian packages and starts the SLURM daemons)"
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        return "local_cluster.sh needs a Debian-like system (apt-get) to install SLURM"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[None]:
    was_up = cluster_is_up()
    problem = None if was_up else cannot_start()
    if problem is None and not was_up:
        started = subprocess.run([str(CLUSTER), "start"], capture_output=True, text=True, timeout=900, check=False)
        if started.returncode != 0:
            problem = f"local_cluster.sh start failed:\n{started.stdout[-2000:]}{started.stderr[-3000:]}"
    if problem is not None:
        if in_ci():
            pytest.fail(f"the SLURM tests cannot run: {problem}", pytrace=False)
        pytest.skip(f"no local SLURM cluster: {problem}")
    yield
    if not was_up:  # a cluster someone started before the tests stays up
        subprocess.run([str(CLUSTER), "stop"], capture_output=True, text=True, timeout=300, check=False)


def sweep_env() -> dict[str, str]:
    """The environment of a submitting user; jobs import tests.* (user models) from the checkout."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1", "PYTHONPATH": str(REPO)}
    for key in [k for k in env if k.startswith("SLURM_")] + ["LOCAL_RANK", "RANK", "WORLD_SIZE"]:
        env.pop(key, None)  # never inherit a surrounding job's identity
    return env


def sweep_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "train", "-m", "hydra/launcher=slurm", *args]


def sweep(args: list[str], cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    """``python -m train -m hydra/launcher=slurm ARGS``, to the end of every job."""
    return subprocess.run(
        sweep_command(args), cwd=cwd, env=sweep_env(), capture_output=True, text=True, timeout=timeout
    )
