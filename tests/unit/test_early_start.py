"""Local ranks started before rank 0 imports torch (job/early_start.py): which jobs, which environment, no orphans."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from disttrain.job import early_start
from disttrain.job.early_start import discard_unclaimed, maybe_start_local_ranks, should_start_early, take_started_ranks
from disttrain.job.preflight import preflight
from disttrain.launch.env import CHILD_ENV_FLAG, PARENT_PID_ENV, process_role
from disttrain.launch.local import start_local_ranks
from tests.conftest import CONF, TINY_MODEL

RANK_ZERO_KEYS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment of a process the user started (no launcher variables from the test runner)."""
    for key in (*RANK_ZERO_KEYS, CHILD_ENV_FLAG, PARENT_PID_ENV, "SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "RANK"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize(
    ("overrides", "early"),
    [
        ([], True),  # hw=cpu: 2 local ranks
        (["dry_run=true"], False),  # spawns nothing
        (["trainer.max_restarts=1"], False),  # this process becomes the supervisor
        (["hw.devices_per_node=1"], False),  # one rank: nothing to spawn
    ],
)
def test_only_a_plain_local_launch_starts_its_ranks_early(
    clean_env: None, tmp_path: Path, overrides: list[str], early: bool
) -> None:
    prepared = preflight([*TINY_MODEL, *overrides, f"hydra.run.dir={tmp_path / 'run'}"], CONF).prepared
    assert should_start_early(prepared) is early
    assert should_start_early(None) is False  # a multirun job or restart attempt prepares its own


@pytest.mark.parametrize("launcher", [{"SLURM_NTASKS": "2"}, {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"}])
def test_a_cluster_task_never_starts_ranks(
    clean_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launcher: dict[str, str]
) -> None:
    prepared = preflight([*TINY_MODEL, f"hydra.run.dir={tmp_path / 'run'}"], CONF).prepared
    for key, value in launcher.items():
        monkeypatch.setenv(key, value)
    assert should_start_early(prepared) is False


def env_dump_command(path: Path) -> list[str]:
    """A child that writes the launcher variables it was started with to ``path`` as JSON."""
    keys = [*RANK_ZERO_KEYS, CHILD_ENV_FLAG, PARENT_PID_ENV]
    code = f"import json, os, sys; open(sys.argv[1], 'w').write(json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))"
    return [sys.executable, "-c", code, str(path)]


def test_started_ranks_get_the_job_env_and_rank_zero_joins_only_when_asked(clean_env: None, tmp_path: Path) -> None:
    before = process_role()
    ranks = start_local_ranks(3, lambda rank: env_dump_command(tmp_path / f"rank{rank}.json"), cwd=str(tmp_path))
    assert ranks.wait() == []
    # Rank 0's role is what it was: NODE_RANK/WORLD_SIZE would make it a cluster task before it joins the job.
    assert process_role() == before and all(key not in os.environ for key in RANK_ZERO_KEYS)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (1, 2)]
    assert [s["LOCAL_RANK"] for s in seen] == ["1", "2"] and [s[CHILD_ENV_FLAG] for s in seen] == ["1", "2"]
    assert {s["WORLD_SIZE"] for s in seen} == {"3"} and {s[PARENT_PID_ENV] for s in seen} == {str(os.getpid())}
    assert seen[0]["MASTER_PORT"] == seen[1]["MASTER_PORT"] == ranks.rank_zero_env["MASTER_PORT"]
    ranks.become_rank_zero()
    assert (os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"], os.environ["NODE_RANK"]) == ("0", "3", "0")
    assert os.environ["MASTER_PORT"] == seen[0]["MASTER_PORT"]
    ranks.restore_env()
    assert all(key not in os.environ for key in RANK_ZERO_KEYS)


def test_ranks_of_a_job_that_ends_before_taking_them_are_killed(
    clean_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared = preflight([*TINY_MODEL, f"hydra.run.dir={tmp_path / 'run'}"], CONF).prepared
    monkeypatch.setattr(
        early_start, "child_command", lambda *args: [sys.executable, "-c", "import time; time.sleep(60)"]
    )
    ranks = maybe_start_local_ranks(prepared, "train", [], tmp_path / "run")
    assert ranks is not None and len(ranks.procs) == 1 and ranks.procs[0].poll() is None
    discard_unclaimed()
    assert ranks.procs[0].returncode == -9 and take_started_ranks() is None
    # Taken ranks belong to the job (run.spawn): discarding leaves them alone.
    ranks = maybe_start_local_ranks(prepared, "train", [], tmp_path / "run")
    assert take_started_ranks() is ranks
    discard_unclaimed()
    assert ranks is not None and ranks.procs[0].poll() is None
    ranks.kill()
