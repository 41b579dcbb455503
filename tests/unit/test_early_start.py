"""Local ranks started before rank 0 imports torch (job/launcher.py): which jobs, which environment, no orphans;
what kind of launcher each process is."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from disttrain.job import launcher as launcher_module
from disttrain.job.launcher import Launcher, LaunchKind
from disttrain.job.preflight import preflight
from disttrain.job.prepare import Prepared
from disttrain.launch.env import CHILD_ENV_FLAG, PARENT_PID_ENV, process_role
from disttrain.launch.local import start_local_ranks
from tests.conftest import CONF, TINY_MODEL

RANK_ZERO_KEYS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment of a process the user started (no launcher variables from the test runner)."""
    for key in (*RANK_ZERO_KEYS, CHILD_ENV_FLAG, PARENT_PID_ENV, "SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "RANK"):
        monkeypatch.delenv(key, raising=False)


def launcher_of(prepared: Prepared | None, run_dir: Path) -> Launcher:
    return Launcher.of_this_process(prepared, run_dir, "train", [])


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
    assert launcher_of(prepared, tmp_path).starts_early() is early
    assert launcher_of(None, tmp_path).starts_early() is False  # a multirun job or restart attempt prepares its own


@pytest.mark.parametrize("launcher", [{"SLURM_NTASKS": "2"}, {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"}])
def test_a_cluster_task_never_starts_ranks(
    clean_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launcher: dict[str, str]
) -> None:
    prepared = preflight([*TINY_MODEL, f"hydra.run.dir={tmp_path / 'run'}"], CONF).prepared
    for key, value in launcher.items():
        monkeypatch.setenv(key, value)
    assert launcher_of(prepared, tmp_path).starts_early() is False
    assert launcher_of(prepared, tmp_path).kind() is LaunchKind.CLUSTER_TASK


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
        launcher_module, "child_command", lambda *args: [sys.executable, "-c", "import time; time.sleep(60)"]
    )
    monkeypatch.setattr(launcher_module, "pools_untouched", lambda: False)  # started now, as new interpreters
    launcher = launcher_of(prepared, tmp_path / "run")
    launcher.start_before_imports()
    ranks = launcher._early
    assert ranks is not None and len(ranks.procs) == 1 and ranks.procs[0].poll() is None
    assert launcher.took_early_ranks() and launcher.kind() is LaunchKind.EXEC
    launcher.discard()
    assert ranks.procs[0].returncode == -9 and not launcher.took_early_ranks()
    # Taken ranks belong to the job (Job.spawn): discarding leaves them alone.
    launcher = launcher_of(prepared, tmp_path / "run")
    launcher.start_before_imports()
    assert prepared is not None
    ranks = launcher.join(prepared)
    try:
        assert ranks is not None and ranks is not launcher._early and os.environ["LOCAL_RANK"] == "0"
        launcher.discard()
        assert ranks.procs[0].poll() is None
    finally:
        assert ranks is not None
        ranks.kill()  # restores this process's environment


@pytest.mark.parametrize(
    ("overrides", "env", "kind"),
    [
        ([], {}, LaunchKind.EXEC),  # (forked only when asked before the imports: test_fork.py)
        (["hw.devices_per_node=1"], {}, LaunchKind.ONE_PROCESS),
        (["trainer.max_restarts=2"], {}, LaunchKind.SUPERVISOR),
        (["trainer.max_restarts=2"], {"DISTTRAIN_RESTART_ATTEMPT": "1"}, LaunchKind.EXEC),  # an attempt spawns
        ([], {CHILD_ENV_FLAG: "1"}, LaunchKind.SPAWNED_RANK),
        (["trainer.max_restarts=2"], {"SLURM_NTASKS": "2"}, LaunchKind.CLUSTER_TASK),
    ],
)
def test_each_process_is_one_kind_of_launcher(
    clean_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str], env: dict, kind: LaunchKind
) -> None:
    prepared = preflight([*TINY_MODEL, *overrides, f"hydra.run.dir={tmp_path / 'run'}"], CONF).prepared
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    launcher = launcher_of(None, tmp_path)  # as a process that prepares its job after the imports
    assert prepared is not None and launcher.kind(prepared) is kind
    if kind not in (LaunchKind.FORK, LaunchKind.EXEC):
        assert launcher.join(prepared) is None  # only a local launch of several ranks starts any
    assert launcher.watch_alone(prepared) is None or kind is LaunchKind.ONE_PROCESS
