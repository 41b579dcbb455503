"""A non-zero rank that torchrun or srun started with the user's command joins rank 0's run dir as our local ranks
do (job/preflight.py cluster_rank_job): its own log, and no .hydra/ record for rank 0's launch check to trip on."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from disttrain.job.preflight import cluster_rank_job
from disttrain.launch.env import CHILD_ENV_FLAG
from tests.conftest import CONF

LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "NODE_RANK")
TORCHRUN = {"TORCHELASTIC_RUN_ID": "job", "GROUP_RANK": "0", "WORLD_SIZE": "4"}
SRUN = {"SLURM_NTASKS": "4"}


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch):
    for key in (*LAUNCHER_KEYS, CHILD_ENV_FLAG):
        monkeypatch.delenv(key, raising=False)

    def set_env(env: dict[str, str]) -> None:
        for key, value in env.items():
            monkeypatch.setenv(key, value)

    return set_env


@pytest.mark.parametrize(("launcher", "rank_key"), [(TORCHRUN, "RANK"), (SRUN, "SLURM_PROCID")])
def test_a_cluster_rank_other_than_zero_logs_to_its_own_file_and_leaves_hydra_record_to_rank_zero(
    launched, launcher: dict[str, str], rank_key: str
) -> None:
    launched({**launcher, rank_key: "3"})
    joining = cluster_rank_job(["model=gpt-nano", "hydra.run.dir=/runs/a"])
    assert joining == ["hydra.output_subdir=null", "hydra.job.name=train_rank3"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=joining, return_hydra_config=True)
    assert cfg.hydra.output_subdir is None
    assert cfg.hydra.job.name == "train_rank3"


@pytest.mark.parametrize(
    ("env", "argv"),
    [
        ({**TORCHRUN, "RANK": "0"}, []),  # rank 0 writes the record (after checking the dir)
        ({"RANK": "1", "WORLD_SIZE": "2"}, []),  # no cluster launcher: our own rank-0 environment
        ({**TORCHRUN, "RANK": "1", CHILD_ENV_FLAG: "1"}, []),  # our local rank: launch/local.py gave it the overrides
        ({**TORCHRUN, "RANK": "1"}, ["-m", "optimizer.lr=1e-3,2e-3"]),  # a sweep names its own jobs
    ],
)
def test_other_processes_keep_their_command(launched, env: dict[str, str], argv: list[str]) -> None:
    launched(env)
    assert cluster_rank_job(argv) == []


def test_a_name_the_user_gave_is_kept(launched) -> None:
    launched({**TORCHRUN, "RANK": "2"})
    assert cluster_rank_job(["hydra.job.name=mine"]) == ["hydra.output_subdir=null"]
