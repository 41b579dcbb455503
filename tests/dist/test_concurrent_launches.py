"""Runs started together never share a run dir (job/claim.py), end to end.

One batch of launches, all at once from the test's directories: four of the default command in the same second
(Hydra's clock pinned to one instant, pinned_clock_train.py) and two naming the same ``hydra.run.dir``. Before the
claim, the four shared ``outputs/<date>/<time>`` and corrupted each other's checkpoints; the two wrote one dir.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from diagnostics.telemetry import telemetry_path
from tests.conftest import TINY_MODEL, read_manifest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

PINNED_CLOCK = Path(__file__).with_name("pinned_clock_train.py")
STEPS = 5
ARGS = [
    *TINY_MODEL,
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.val_every_n_steps=1000",
    "trainer.val_batches=1",
    "data.num_train_tokens=16384",
    "data.num_val_tokens=2048",
]


@dataclass(frozen=True)
class Launch:
    pid: int
    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class Batch:
    default_cwd: Path
    pinned: float
    defaults: list[Launch]
    named_dir: Path
    named: list[Launch]


def start(command: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        env.pop(key, None)
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> Launch:
    out, err = proc.communicate(timeout=600)
    return Launch(proc.pid, proc.returncode, out, err)


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> Batch:
    root = tmp_path_factory.mktemp("together")
    default_cwd, named_dir = root / "defaults", root / "named" / "run"
    default_cwd.mkdir()
    pinned = float(int(time.time()))
    procs = [start([sys.executable, str(PINNED_CLOCK), str(pinned), *ARGS], default_cwd) for _ in range(4)]
    procs += [start([sys.executable, "-m", "train", *ARGS, f"hydra.run.dir={named_dir}"], root) for _ in range(2)]
    launches = [finish(p) for p in procs]
    return Batch(default_cwd, pinned, launches[:4], named_dir, launches[4:])


def assert_complete_run_of(launch: Launch, run_dir: Path) -> None:
    """``run_dir`` holds exactly this launch's finished run: its claim, record, checkpoint, report and logs."""
    assert json.loads((run_dir / ".claim.json").read_text())["pid"] == launch.pid
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "completed" and manifest["result"]["steps"] == STEPS
    assert manifest["result"]["run_dir"] == str(run_dir.resolve())
    assert f"run dir     {run_dir.resolve()}" in launch.stdout
    checkpoint = run_dir / "checkpoints" / f"step{STEPS:06d}.ckpt"
    assert (checkpoint / "meta.pt").is_file() and not list((run_dir / "checkpoints").glob(".partial-*"))
    report = json.loads((run_dir / "report" / "report.json").read_text())
    assert report["problems"] == [] and report["summary"]["steps_recorded"] > 0
    # One run's files: the two ranks' telemetry, each step recorded once (a second run would repeat them).
    ranks = [telemetry_path(run_dir, rank) for rank in (0, 1)]
    assert sorted((run_dir / "telemetry").glob("rank*.jsonl")) == ranks
    for path in ranks:
        steps = [r["step"] for line in path.read_text().splitlines() if (r := json.loads(line))["kind"] == "step"]
        assert steps == sorted(set(steps)) and steps[-1] == STEPS, (path, steps)  # increasing: one run's
    assert (run_dir / "train.log").is_file() and (run_dir / "train_rank1.log").is_file()
    assert (run_dir / ".hydra" / "overrides.yaml").is_file()


def test_four_default_launches_in_one_second_each_get_their_own_run_dir(batch: Batch) -> None:
    for launch in batch.defaults:
        assert launch.returncode == 0, launch.stdout[-2000:] + launch.stderr[-2000:]
    stamp = time.localtime(batch.pinned)
    day = batch.default_cwd / "outputs" / time.strftime("%Y-%m-%d", stamp)
    second = time.strftime("%H-%M-%S", stamp)
    assert sorted(p.name for p in day.iterdir()) == [second, f"{second}-1", f"{second}-2", f"{second}-3"]
    by_pid = {json.loads((d / ".claim.json").read_text())["pid"]: d for d in day.iterdir()}
    assert sorted(by_pid) == sorted(launch.pid for launch in batch.defaults)
    for launch in batch.defaults:
        assert_complete_run_of(launch, by_pid[launch.pid])


def test_two_launches_naming_one_run_dir_at_once_run_once_and_refuse_once(batch: Batch) -> None:
    ran = [launch for launch in batch.named if launch.returncode == 0]
    refused = [launch for launch in batch.named if launch.returncode == 2]
    assert len(ran) == 1 and len(refused) == 1, [(x.returncode, x.stderr[-2000:]) for x in batch.named]
    lines = [line for line in refused[0].stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in refused[0].stderr, refused[0].stderr
    assert lines[0].startswith("disttrain: config error: hydra.run.dir: ") and "already holds a run" in lines[0]
    assert "hydra.run.dir=<new dir>" in lines[0] and refused[0].stdout == ""
    assert_complete_run_of(ran[0], batch.named_dir)
