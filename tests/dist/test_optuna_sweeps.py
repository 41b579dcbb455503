"""hydra/sweeper=optuna end to end on the local launcher: pruning, a killed sweep continued, screening.

Trials are one process (hw.devices_per_node=1) and a few steps: what is under test is the sweeper and the study,
not the training; test_a_pruned_two_rank_trial_ends_every_rank_cleanly covers the ranks' agreement on a pruning
verdict (rank 0 asks the pruner, every rank stops at the same validation) and a 2-rank job's objective reaching
the study."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml

from tests.conftest import read_manifest, run_cli

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TRIAL = [
    "hw.devices_per_node=1",
    "trainer.max_steps=8",
    "trainer.val_every_n_steps=2",
    "trainer.val_batches=1",
    "trainer.ckpt_every_n_steps=0",
    "trainer.log_every_n_steps=2",
    "diagnostics=off",
    "data.num_train_tokens=16384",
    "data.num_val_tokens=2048",
    "optimizer.warmup_steps=0",
]
# A 2-layer, 64-wide model: its learning curves still part the learning rates by validation 2, in a fifth of the
# default model's step (the memory screen below keeps the default model: its activations are what it predicts).
SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.ffn_hidden=256"]
SWEEP = ["-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=grid", "hydra.sweeper.n_jobs=1"]


def trials(sweep: Path) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="disttrain", storage=f"sqlite:///{sweep / 'optuna.db'}").get_trials()


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def test_a_pruner_stops_hopeless_trials_which_a_full_run_confirms_worse(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    lrs = "optimizer.lr=choice(3e-3,1e-3,3e-4,1e-4,3e-5,1e-5,3e-6,1e-6)"
    pruner = ["hydra/sweeper/pruner=median", "hydra.sweeper.pruner.n_startup_trials=2", "hydra.sweeper.n_trials=8"]
    ok(
        run_cli(
            [*SWEEP, *pruner, lrs, *TRIAL, *SMALL, "hydra.sweeper.sampler.seed=0", f"hydra.sweep.dir={sweep}"], tmp_path
        )
    )
    done = trials(sweep)
    assert len(done) == 8
    pruned = [t for t in done if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned, [(t.params, t.state) for t in done]
    for trial in pruned:  # ended cleanly at a validation before max_steps, with its report and status
        manifest = read_manifest(sweep / trial.user_attrs["disttrain.job"])
        assert manifest["status"] == "pruned" and manifest["pruned_at_step"] < 8
        assert manifest["result"]["steps"] == manifest["pruned_at_step"]
    report = yaml.safe_load((sweep / "report" / "sweep.json").read_text())
    statuses = {r["name"]: r["status"] for r in report["runs"]}
    named = {"COMPLETE": "completed", "PRUNED": "pruned"}
    assert sorted(statuses.values()) == sorted(named[t.state.name] for t in done)
    assert "trial.number" not in report["varying"]
    # The pruned trial run in full (no study): its final validation loss is worse than the best completed trial's.
    worst = max(pruned, key=lambda t: t.number)
    full = tmp_path / "full"
    ok(run_cli([*TRIAL, *SMALL, f"optimizer.lr={worst.params['optimizer.lr']}", f"hydra.run.dir={full}"], tmp_path))
    best = min(t.value for t in done if t.state == optuna.trial.TrialState.COMPLETE)
    assert read_manifest(full)["result"]["val_loss"] > best


def test_a_killed_sweep_rerun_continues_its_study(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = [*SWEEP, "optimizer.lr=choice(3e-3,1e-3,1e-4)", *TRIAL, *SMALL, f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "train", *args], cwd=tmp_path, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 300
    while not (sweep / "1" / "run.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, f"the sweep ended (exit {proc.returncode}) before its second trial started training"
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep dies while its second trial trains
    proc.wait()
    first = trials(sweep)
    assert [t.state.name for t in first[:2]] == ["COMPLETE", "RUNNING"]
    best_before = first[0].value

    out = ok(run_cli(args, tmp_path))  # the same command
    assert "continuing study 'disttrain': 1 of 3 trials done" in out
    after = trials(sweep)
    numbers = [t.number for t in after]
    assert numbers == list(range(len(after))) and len(after) == 4  # the count went on: 0 and 1 kept, 2 and 3 new
    assert after[1].state == optuna.trial.TrialState.FAIL and after[1].user_attrs["disttrain.interrupted"]
    complete = [t for t in after if t.state == optuna.trial.TrialState.COMPLETE]
    assert sorted(t.params["optimizer.lr"] for t in complete) == [1e-4, 1e-3, 3e-3]  # the interrupted one re-asked
    assert after[0].value == best_before
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == min(t.value for t in complete)
    assert sorted(p.name for p in sweep.iterdir() if p.name.isdigit()) == ["0", "1", "2", "3"]


def test_a_trial_the_memory_check_refuses_is_screened_and_never_launched(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    # 4096 sequences of 16 tokens per micro-batch: ~3 GiB of activations predicted, over the 1 GiB profile.
    memory = ["hw.memory_per_device_gib=1", "trainer.micro_batch_size=choice(4096,4)", "model.seq_len=16"]
    out = ok(
        run_cli(
            [
                *SWEEP,
                *memory,
                *TRIAL,
                "trainer.max_steps=2",
                "data.num_train_tokens=131072",
                f"hydra.sweep.dir={sweep}",
            ],
            tmp_path,
        )
    )
    done = {t.params["trainer.micro_batch_size"]: t for t in trials(sweep)}
    screened = done[4096]
    assert screened.state == optuna.trial.TrialState.FAIL
    assert screened.user_attrs["disttrain.screened"].startswith("strategy: predicted")
    assert "disttrain.job" not in screened.user_attrs  # never launched: no job dir
    assert done[4].state == optuna.trial.TrialState.COMPLETE
    assert [p.name for p in sweep.iterdir() if p.name.isdigit()] == ["0"]
    report = yaml.safe_load((sweep / "report" / "sweep.json").read_text())
    (row,) = [r for r in report["runs"] if r["status"] == "screened"]
    assert row["overrides"] == {"trainer.micro_batch_size": "4096"} and "GiB usable" in row["error"]
    assert "1 screened" in out


def test_a_pruned_two_rank_trial_ends_every_rank_cleanly(tmp_path: Path) -> None:
    """Two trials of 2 gloo ranks each: the second (a learning rate that cannot learn) is pruned at a validation; both
    of its ranks stop there, the run ends with status pruned, and no rank is reported failed."""
    sweep = tmp_path / "sweep"
    pruner = ["hydra/sweeper/pruner=median", "hydra.sweeper.pruner.n_startup_trials=1"]
    two_ranks = [o for o in TRIAL if not o.startswith("hw.devices_per_node")] + ["hw.devices_per_node=2", *SMALL]
    grid = ["optimizer.lr=choice(3e-3,1e-7)", "hydra.sweeper.sampler.seed=1"]  # seed 1: 3e-3 first, 1e-7 second
    ok(run_cli([*SWEEP, *pruner, *grid, *two_ranks, f"hydra.sweep.dir={sweep}"], tmp_path))
    done = {t.params["optimizer.lr"]: t for t in trials(sweep)}
    assert done[1e-7].state == optuna.trial.TrialState.PRUNED, [(t.params, t.state) for t in done.values()]
    run_dir = sweep / done[1e-7].user_attrs["disttrain.job"]
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "pruned" and manifest["world"]["world_size"] == 2
    assert manifest["pruned_at_step"] < 8
    assert not (run_dir / "failure.json").exists()
    assert "Traceback" not in (run_dir / "train_rank1.log").read_text()  # rank 1 stopped with rank 0, cleanly
    # The completed trial ran its own second rank, and the objective it returned (objective=val_loss, minimized)
    # reached Optuna: the study's best is its final validation loss, paired with its learning rate.
    completed = sweep / done[3e-3].user_attrs["disttrain.job"]
    finished = read_manifest(completed)
    assert finished["status"] == "completed" and (completed / "train_rank1.log").exists()
    assert done[3e-3].value == pytest.approx(finished["result"]["val_loss"])
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_value"] == pytest.approx(finished["result"]["val_loss"])
    assert results["best_params"] == {"optimizer.lr": 3e-3}
