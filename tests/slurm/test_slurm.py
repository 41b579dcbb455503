"""Real SLURM jobs on the local cluster (tests/slurm/local_cluster.sh): sweeps, 2 nodes, requeue, crashes.

Every job is submitted by ``python -m train -m hydra/launcher=slurm`` exactly as a user would; the fake nodes
n1 and n2 run on this host, so a "2-node" job is two tasks on two SLURM nodes talking gloo over 127.0.0.1.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import TINY_MODEL, load_checkpoint, read_manifest, run_cli
from tests.slurm.conftest import sweep, sweep_command, sweep_env

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

TINY = [
    *TINY_MODEL,
    "data.num_train_tokens=65536",
    "data.num_val_tokens=8192",
    "trainer.log_every_n_steps=1",
    "trainer.val_every_n_steps=1000",
    "trainer.val_batches=1",
    "trainer.micro_batch_size=4",
    "optimizer.warmup_steps=2",
    "precision=fp32",
]
STEPS = 20
# One data-parallel job of world size 2, the same on one node (local) and on two SLURM nodes.
PAIR = [*TINY, "optimizer.lr=1e-3", f"trainer.max_steps={STEPS}", "trainer.ckpt_every_n_steps=5"]
TWO_NODES = ["hw.num_nodes=2", "hw.devices_per_node=1"]


def train_losses(run_dir: Path, name: str = "metrics.csv") -> dict[int, float]:
    with (run_dir / "metrics" / name).open() as handle:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(handle) if row["train/loss"]}


def attempts(run_dir: Path) -> list[dict]:
    path = run_dir / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    state = load_checkpoint(checkpoint)["state_dict"]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def sweep_report(sweep_dir: Path) -> dict:
    return json.loads((sweep_dir / "report" / "sweep.json").read_text())


def check(result: subprocess.CompletedProcess, ok: bool = True) -> None:
    assert (result.returncode == 0) == ok, f"rc={result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference SLURM job: 2 nodes x 1 task, uninterrupted."""
    tmp = tmp_path_factory.mktemp("two-node")
    check(sweep([*PAIR, *TWO_NODES, f"hydra.sweep.dir={tmp / 'sweep'}"], cwd=tmp))
    return tmp / "sweep" / "0"


def test_sweep_of_four_jobs_each_with_its_report_and_one_ranking(tmp_path: Path) -> None:
    # An Optuna sweep (grid sampler: exactly the 2x2 grid) whose one batch of 4 trials is one SLURM job array.
    sweep_dir = tmp_path / "sweep"
    optuna = ["hydra/sweeper=optuna", "hydra/sweeper/sampler=grid", "hydra.sweeper.n_jobs=4"]
    grid = ["optimizer.lr=choice(1e-3,3e-3)", "strategy=choice(ddp,fsdp)"]
    args = [*TINY, "hw.devices_per_node=1", "trainer.max_steps=10", *optuna, *grid]
    check(sweep([*args, f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path))

    job_ids = set()
    for job in range(4):
        run_dir = sweep_dir / str(job)
        assert read_manifest(run_dir)["status"] == "completed"
        assert (run_dir / "telemetry" / "rank0000.jsonl").stat().st_size > 0
        assert json.loads((run_dir / "report" / "report.json").read_text())["summary"]["tokens_per_s"] > 0
        (start,) = [a for a in attempts(run_dir) if a["event"] == "start"]  # it ran as a SLURM job, once
        job_ids.add(start["job_id"])
    assert len(job_ids) == 4
    # Each job's rank 0 returned its final validation loss through the SLURM launcher to Optuna (minimized).
    val_losses = [read_manifest(sweep_dir / str(job))["result"]["val_loss"] for job in range(4)]
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(min(val_losses))

    report = sweep_report(sweep_dir)
    assert report["varying"] == ["optimizer.lr", "strategy"] and report["failed"] == []
    runs = report["runs"]
    assert sorted(r["name"] for r in runs) == ["0", "1", "2", "3"]
    losses = [r["final_loss"] for r in runs]
    assert losses == sorted(losses) and all(loss is not None for loss in losses)
    for run in runs:
        assert run["status"] == "completed" and run["tokens_per_s"] > 0 and run["mfu"] > 0
        assert run["has_report"] and run["peak_memory_bytes"] > 0
    assert report["pareto_front"] and set(report["pareto_front"]) <= {"0", "1", "2", "3"}
    html = (sweep_dir / "report" / "sweep.html").read_text()
    assert html.count("<svg") == 2 and "optimizer.lr=0.003 strategy=fsdp" in html


def test_optuna_sweep_on_slurm_keeps_its_study_in_storage_and_prunes_there(tmp_path: Path) -> None:
    # Two trials, one after the other, each a SLURM job: the jobs report their validation losses to the study in
    # the sweep dir's SQLite file from the SLURM nodes; with n_startup_trials=1 the second trial may be pruned.
    import optuna

    sweep_dir = tmp_path / "sweep"
    optuna_args = ["hydra/sweeper=optuna", "hydra/sweeper/sampler=grid", "hydra.sweeper.n_jobs=1"]
    pruner = ["hydra/sweeper/pruner=median", "hydra.sweeper.pruner.n_startup_trials=1"]
    steps = ["trainer.max_steps=6", "trainer.val_every_n_steps=2", "trainer.ckpt_every_n_steps=0", "diagnostics=off"]
    args = [*TINY, "hw.devices_per_node=1", *steps, *optuna_args, *pruner, "optimizer.lr=choice(3e-3,1e-6)"]
    check(sweep([*args, f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path))
    study = optuna.load_study(study_name="disttrain", storage=f"sqlite:///{sweep_dir / 'optuna.db'}")
    trials = study.get_trials()
    assert len(trials) == 2
    for trial in trials:
        run_dir = sweep_dir / trial.user_attrs["disttrain.job"]
        assert trial.intermediate_values  # reported from the SLURM job's rank 0
        (start,) = [a for a in attempts(run_dir) if a["event"] == "start"]  # it ran as a SLURM job
        assert start["job_id"]
        status = read_manifest(run_dir)["status"]
        assert trial.state.name.lower() == {"completed": "complete", "pruned": "pruned"}[status]
    statuses = {r["status"] for r in sweep_report(sweep_dir)["runs"]}
    assert statuses <= {"completed", "pruned"}


def test_two_node_job_matches_one_node_two_processes(two_node_run: Path, tmp_path: Path) -> None:
    local = tmp_path / "local"
    result = run_cli([*PAIR, "hw.devices_per_node=2", f"hydra.run.dir={local}"], cwd=tmp_path)
    check(result)

    manifest = read_manifest(two_node_run)
    assert manifest["world"]["num_nodes"] == 2 and manifest["world"]["world_size"] == 2
    (start,) = [a for a in attempts(two_node_run) if a["event"] == "start"]
    assert start["num_nodes"] == 2 and start["num_tasks"] == 2 and start["nodelist"] == "n[1-2]"
    # Each task logs to its own file, as local ranks do.
    assert "GLOBAL_RANK: 1" in (two_node_run / "train_rank1.log").read_text()
    assert "GLOBAL_RANK: 1" not in (two_node_run / "train.log").read_text()
    slurm, reference = train_losses(two_node_run), train_losses(local)
    assert sorted(slurm) == sorted(reference) == list(range(STEPS))
    worst = max(abs(slurm[s] - reference[s]) for s in range(STEPS))
    assert worst <= 1e-4, f"max |loss(2 nodes) - loss(1 node x 2)| = {worst:.2e}"
    assert slurm[STEPS - 1] < slurm[0] - 0.5  # it learned: parity is not two flat lines


def wait_for(predicate, proc: subprocess.Popen, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the sweep ended (rc={proc.returncode}) before {what}:\n{proc.stdout.read()[-4000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_signal_checkpoints_requeues_and_resumes_to_identical_weights(two_node_run: Path, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    run_dir = sweep_dir / "0"
    command = sweep_command([*PAIR, *TWO_NODES, f"hydra.sweep.dir={sweep_dir}"])
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=sweep_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        # What SLURM does signal_delay_s before the time limit (or on preemption): USR2 to every task.
        wait_for(lambda: (run_dir / "checkpoints" / "step000005.ckpt").exists(), proc, 300, "the step-5 checkpoint")
        job_id = attempts(run_dir)[0]["job_id"]
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
        output, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-4000:]

    events = attempts(run_dir)
    assert [(e["event"], e["restart_count"]) for e in events] == [
        ("start", 0),
        ("preempted", 0),
        ("start", 1),
        ("end", 1),
    ]
    preempted = events[1]
    step = preempted["step"]
    assert 5 < step < STEPS and preempted["requeued"] and preempted["signal"] == "SIGUSR2"
    assert events[2]["resumed_from"] == str((run_dir / "checkpoints" / f"step{step:06d}.ckpt").resolve())
    manifest = read_manifest(run_dir)
    assert (
        manifest["status"] == "completed" and manifest["result"]["steps"] == STEPS and manifest["restart_attempt"] == 1
    )

    # Both attempts' metrics stay in the run dir; the resumed steps reproduce the uninterrupted run.
    first, second, full = (
        train_losses(run_dir, "metrics_attempt0.csv"),
        train_losses(run_dir),
        train_losses(two_node_run),
    )
    assert min(first) == 0 and max(first) >= step - 1 and sorted(second) == list(range(step, STEPS))
    for s in range(step, STEPS):
        assert second[s] == pytest.approx(full[s], abs=1e-6)
    expected = model_weights(two_node_run / "checkpoints" / f"step{STEPS:06d}.ckpt")
    actual = model_weights(run_dir / "checkpoints" / f"step{STEPS:06d}.ckpt")
    assert expected and sorted(expected) == sorted(actual)
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), f"{name} differs from the uninterrupted run"
    assert "2 attempts" in (sweep_dir / "report" / "sweep.md").read_text()


USER_MODEL = [
    "~model",
    "+model.vocab_size=10",
    "+model.seq_len=16",
    "~data",
    "+data._target_=tests.plugins.CountingData",
]


def test_crashing_job_is_reported_failed_and_the_sweep_still_ends(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    models = "+model._target_=tests.plugins.BigramModel,tests.slurm.crash_model.CrashingBigram"
    args = [
        *USER_MODEL, models, "hw.devices_per_node=2", "trainer.max_steps=12", "trainer.micro_batch_size=4",
        "trainer.val_every_n_steps=1000", "trainer.val_batches=1", "optimizer.lr=0.05", "optimizer.warmup_steps=2",
    ]  # fmt: skip
    result = sweep([*args, f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path, timeout=300)
    check(result, ok=False)  # Hydra ends the multirun with the failed job's error, after every job ended

    report = sweep_report(sweep_dir)
    by_model = {r["overrides"]["model._target_"].rsplit(".", 1)[-1]: r for r in report["runs"]}
    assert by_model["BigramModel"]["status"] == "completed"
    crashed = by_model["CrashingBigram"]
    assert crashed["status"] == "failed" and report["failed"] == [crashed["name"]]
    assert crashed["error"] == "RuntimeError: deliberate crash in training forward 3"
    assert "crash_model.py" in crashed["error_detail"]
    failure = json.loads((sweep_dir / crashed["name"] / "failure.json").read_text())
    assert failure["rank"] == 1  # the rank that raised, not the one SLURM stopped after it
    assert "deliberate crash" in (sweep_dir / "report" / "sweep.md").read_text().split("## Failed runs")[1]


def test_tune_runs_its_runs_as_slurm_jobs(tmp_path: Path) -> None:
    """``python -m tune hydra/launcher=slurm``: the start run is a SLURM job that lands in the tune's round0 dir and is
    diagnosed from there (a budget too short for an A/B ends the tune after it: one short job)."""
    out = tmp_path / "tune"
    train = list(TINY)
    command = [sys.executable, "-m", "tune", "hydra/launcher=slurm", *train, "tune.steps=10", "tune.budget_min=0.05"]
    result = subprocess.run(
        [*command, f"tune.output_dir={out}"], cwd=tmp_path, env=sweep_env(), capture_output=True, text=True, timeout=400
    )
    check(result)
    assert "run as slurm jobs (hydra/launcher=slurm)" in result.stdout
    summary = json.loads((out / "tune" / "summary.json").read_text())
    assert summary["start_tokens_per_s"] > 0 and summary["rounds"] == []
    assert (out / "round0" / "telemetry").is_dir() and (out / "round0" / "report" / "report.json").is_file()
    jobs = [p.name for p in (out / "round0.slurm" / ".submitit").iterdir() if p.is_dir()]
    assert len(jobs) == 1 and jobs[0].split("_")[0].isdigit()  # submitit's folder of the one SLURM job, by its id
    assert summary["final_overrides"] == train  # the launcher is where the runs went, not part of the config
