"""SLURM pieces without a cluster: task identity, rendezvous, the launcher geometry, preemption, failure records."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from disttrain.config.errors import ConfigError
from disttrain.job.preflight import preflight
from disttrain.job.sweeps import FAILURE_FILE, record_failure
from disttrain.launch.env import process_role
from disttrain.launch.slurm import (
    current_task,
    first_node,
    master_port,
    node_address,
    record_attempt,
    rendezvous_env,
)
from disttrain.reliability.preemption import CheckpointOnSignal, Preempted, keep_previous_metrics
from tests.conftest import CONF, compose_train

TASK_ENV = {
    "SLURM_JOB_ID": "4711",
    "SLURM_NTASKS": "4",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_RESTART_COUNT": "2",
}


def test_task_identity_comes_from_the_slurm_environment() -> None:
    task = current_task(TASK_ENV)
    assert task is not None
    assert (task.job_id, task.restart_count, task.global_rank, task.local_rank) == ("4711", 2, 3, 1)
    assert (task.node_rank, task.num_tasks, task.num_nodes, task.nodelist) == (1, 4, 2, "n[1-2]")
    assert current_task({"SLURM_JOB_ID": "1"}) is None  # an allocation's shell is not a task of a step
    assert current_task({}) is None


def test_first_node_address_falls_back_to_slurms_node_addr() -> None:
    assert first_node("n[1-2]", expand=lambda nodelist: "n1\nn2\n") == "n1"
    assert (
        node_address("localhost", show_node=lambda n: pytest.fail("a resolvable name needs no scontrol")) == "localhost"
    )
    record = "NodeName=nx-unresolvable.invalid Arch=x86_64 NodeAddr=10.1.2.3 NodeHostName=vm Port=17001"
    assert node_address("nx-unresolvable.invalid", show_node=lambda n: record) == "10.1.2.3"
    with pytest.raises(RuntimeError, match="NodeAddr"):
        node_address("nx-unresolvable.invalid", show_node=lambda n: "NodeName=nx State=IDLE")


def test_rendezvous_is_the_same_for_every_task_and_respects_user_exports() -> None:
    one_node = current_task({**TASK_ENV, "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "n1"})
    assert one_node is not None
    env = rendezvous_env(one_node, env={})
    assert env == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port("4711"))}
    assert rendezvous_env(one_node, env={"MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29500"}) == {}
    assert master_port("4711") == master_port("4711") != master_port("4712")
    assert all(1024 < master_port(str(j)) < 65536 for j in (0, 1, 39999, 40000, 10**9))


def test_a_requeued_job_counts_as_a_restart() -> None:
    assert process_role({**TASK_ENV, "SLURM_RESTART_COUNT": "0"}).attempt == 0
    role = process_role({**TASK_ENV, "SLURM_RESTART_COUNT": "1"})
    assert (role.attempt, role.global_rank, role.cluster, role.is_global_zero) == (1, 3, True, False)
    assert process_role({"DISTTRAIN_RESTART_ATTEMPT": "2", "SLURM_RESTART_COUNT": "1"}).attempt == 2


def test_a_spawned_local_rank_is_never_global_zero() -> None:
    role = process_role({"DISTTRAIN_CHILD_RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"})
    assert (role.child, role.local_rank, role.launched_world_size, role.is_global_zero) == (True, 1, 2, False)
    assert not role.starts_the_job and process_role({}).starts_the_job


def test_attempts_are_appended_and_metrics_of_the_previous_attempt_kept(tmp_path: Path) -> None:
    task = current_task(TASK_ENV)
    assert task is not None
    record_attempt(tmp_path, task, "start", resumed_from=None)
    record_attempt(tmp_path, task, "preempted", step=7)
    lines = (tmp_path / "attempts.jsonl").read_text().splitlines()
    assert [(a["event"], a.get("step")) for a in map(json.loads, lines)] == [("start", None), ("preempted", 7)]
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "metrics.csv").write_text("step,train/loss\n0,1.0\n")
    keep_previous_metrics(tmp_path, attempt=0)  # a first attempt moves nothing
    assert (tmp_path / "metrics" / "metrics.csv").exists()
    keep_previous_metrics(tmp_path, attempt=2)
    assert (tmp_path / "metrics" / "metrics_attempt1.csv").read_text().endswith("0,1.0\n")
    assert not (tmp_path / "metrics" / "metrics.csv").exists()


@pytest.mark.parametrize(
    ("hw", "nodes", "tasks", "gpus"), [("cpu", 1, 2, None), ("2x8xh100", 2, 8, 8), ("1xa100", 1, 1, 1)]
)
def test_launcher_geometry_comes_from_the_hw_profile(hw: str, nodes: int, tasks: int, gpus: int | None) -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["hydra/launcher=slurm", f"hw={hw}"], return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (nodes, tasks, gpus)
    assert launcher["_target_"] == "hydra_plugins.disttrain_launcher.slurm_launcher.SlurmLauncher"
    assert "--kill-on-bad-exit=1" in launcher["srun_args"] and launcher["additional_parameters"]["requeue"] is True
    assert launcher["signal_delay_s"] > 0 and launcher["max_num_timeout"] >= 1
    assert compose_train([f"hw={hw}"]).hw.num_nodes == nodes  # and the training config is the same hw


def test_a_slurm_sweep_is_not_refused_for_devices_the_submitting_machine_lacks() -> None:
    with pytest.raises(ConfigError, match="hw"):
        preflight(["hw=8xa100"], CONF)  # this CPU box cannot run it itself
    preflight(["-m", "hydra/launcher=slurm", "hw=8xa100,2x8xh100"], CONF)  # the cluster's nodes will
    with pytest.raises(ConfigError, match=r"\(in sweep job #1: hw=8xa100\)"):
        preflight(["-m", "hw=cpu,8xa100"], CONF)  # every job of a local sweep runs here, the later ones too
    with pytest.raises(ConfigError, match="add -m"):
        preflight(["hydra/launcher=slurm"], CONF)  # Hydra would ignore the launcher and train right here


class FakeCheckpoints:
    def __init__(self, ckpt_dir: Path) -> None:
        self.ckpt_dir = ckpt_dir
        self.skip_save = None
        self.last_saved_step = -1
        self.saved: list[int] = []

    def save(self, trainer: object, step: int) -> None:
        self.saved.append(step)


def fake_trainer(step: int, any_rank_flagged: list[bool]) -> SimpleNamespace:
    def reduce_boolean_decision(decision: bool, all: bool = True) -> bool:
        any_rank_flagged.append(decision)
        return decision or any(any_rank_flagged[:-1])

    return SimpleNamespace(global_step=step, strategy=SimpleNamespace(reduce_boolean_decision=reduce_boolean_decision))


def test_signal_saves_once_at_the_step_boundary_and_stops_at_the_next_batch(tmp_path: Path) -> None:
    checkpoints = FakeCheckpoints(tmp_path)
    callback = CheckpointOnSignal(checkpoints)  # type: ignore[arg-type]
    decisions: list[bool] = []
    callback.on_train_batch_end(fake_trainer(5, decisions))
    callback.on_train_batch_start()
    assert checkpoints.saved == [] and decisions == [False]
    callback._flag(signal.SIGUSR2, None)
    callback.on_train_batch_end(fake_trainer(5, decisions))  # same step (accumulation): no second collective
    assert decisions == [False]
    callback.on_train_batch_end(fake_trainer(6, decisions))
    assert checkpoints.saved == [6]
    with pytest.raises(Preempted) as stop:
        callback.on_train_batch_start()
    assert (stop.value.step, stop.value.signal_name) == (6, "SIGUSR2")
    assert stop.value.checkpoint == tmp_path / "step000006.ckpt"


def test_once_the_guard_votes_the_signal_rides_in_its_vote_and_no_collective_of_its_own_runs(tmp_path: Path) -> None:
    checkpoints = FakeCheckpoints(tmp_path)
    callback = CheckpointOnSignal(checkpoints)  # type: ignore[arg-type]
    decisions: list[bool] = []
    trainer = fake_trainer(1, decisions)
    callback.agreed(trainer, 0.0)  # step 1's vote: nobody signalled
    callback.on_train_batch_end(trainer)
    assert decisions == [] and checkpoints.saved == []
    assert callback.flag(trainer) == 0.0
    callback.agreed(trainer, float(signal.SIGUSR1))  # step 2's vote: another rank got USR1, this one nothing
    callback.on_train_batch_end(fake_trainer(2, decisions))
    assert decisions == [] and checkpoints.saved == [2]
    with pytest.raises(Preempted) as stop:
        callback.on_train_batch_start()
    assert (stop.value.step, stop.value.signal_name) == (2, "SIGUSR1")


def test_this_ranks_signal_is_its_part_of_the_vote(tmp_path: Path) -> None:
    callback = CheckpointOnSignal(FakeCheckpoints(tmp_path))  # type: ignore[arg-type]
    callback._flag(signal.SIGUSR2, None)
    callback._flag(signal.SIGUSR1, None)  # the first signal is the one it reports
    assert callback.flag(fake_trainer(3, [])) == float(signal.SIGUSR2)


def test_failure_record_keeps_the_first_error(tmp_path: Path) -> None:
    try:
        raise RuntimeError("first\nsecond line")
    except RuntimeError as err:
        assert record_failure(tmp_path / "run", err, source="job", overrides=["a=1"])
    assert not record_failure(tmp_path / "run", ValueError("later"), source="job")
    record = json.loads((tmp_path / "run" / FAILURE_FILE).read_text())
    assert record["error"] == "RuntimeError: first" and record["overrides"] == ["a=1"]
    assert "test_failure_record_keeps_the_first_error" in record["traceback"]
