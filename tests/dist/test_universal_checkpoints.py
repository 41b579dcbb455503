"""Any checkpoint resumes under any strategy and world size, continuing an uninterrupted run's losses (fp32 CPU).

One uninterrupted DDP run on 2 ranks (checkpoint every step) is the reference for every continuation: all runs
share its global batch of 8, so each step sees the same samples whatever the layout, and the strategies agree with
one process to 1e-4 (test_parity_and_resume, test_deepspeed, test_megatron_cli). The resumes are chained so every
run is both a check and the source of the next: each resumed run writes checkpoints in its own strategy's hands.

    reference ddp x2 --@1--> fsdp x4 (ddp->fsdp, 2->4) --@2--> ddp x1 (fsdp->ddp, 4->1) --@3--> megatron pp2 x2
                     |                                 |    (ddp->megatron pp2, 1->2) --@4--> ddp x2 (megatron pp2->ddp)
                     |                                 `--@2--> megatron tp2 x2 (fsdp->megatron tp2)
                     |--@1--> deepspeed-3 x2 (ddp->ds3) --@2--> deepspeed-2 x2 (ds3->ds2) --@3--> fsdp x2 (ds2->fsdp)
                     `--@4--> ddp x1, resume_weights_only (the optimizer starts afresh, on purpose)

The 1-process checkpoint is resumed on 2 ranks by the Megatron pipeline link, so growing the world rides on a link
that also changes strategy (one launch fewer than a separate 1->2 DDP run). Every run is one ``python -m train``
process tree: 10 tiny runs and one export. An elastic restart (torchrun's workers, 2 then 1) continues the same
reference: 2 more launches, ~20 s at load 3.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from disttrain.planner import Layout
from tests.conftest import load_checkpoint, read_manifest, run_cli
from tests.dist.test_deepspeed import COMMON as DEEPSPEED_COMMON
from tests.dist.test_deepspeed import STEPS, planned_state_bytes, training_state_bytes
from tests.dist.test_parity_and_resume import train_losses

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# test_deepspeed's tiny 6-step run (TINY_MODEL, fp32, lr 1e-3, no diagnostics), with a checkpoint every step.
COMMON = [
    *(arg for arg in DEEPSPEED_COMMON if not arg.startswith("trainer.ckpt_every_n_steps=")),
    "trainer.ckpt_every_n_steps=1",
]
# Every layout below runs the global batch of 8 samples per step.
LAYOUTS = {
    "ddp x2": ["strategy=ddp", "hw.devices_per_node=2", "trainer.micro_batch_size=4"],
    "ddp x1": ["strategy=ddp", "hw.devices_per_node=1", "trainer.micro_batch_size=4", "trainer.global_batch_size=8"],
    "fsdp x4": ["strategy=fsdp", "hw.devices_per_node=4", "trainer.micro_batch_size=2"],
    "fsdp x2": ["strategy=fsdp", "hw.devices_per_node=2", "trainer.micro_batch_size=4"],
    # With the step records on (no profile, calibration or report): the run counts its training state.
    "deepspeed-3 x2": [
        "strategy=deepspeed",
        "strategy.stage=3",
        "hw.devices_per_node=2",
        "trainer.micro_batch_size=4",
        "diagnostics=default",
        "diagnostics.profile=false",
        "diagnostics.calibrate=false",
        "diagnostics.report=false",
    ],
    "deepspeed-2 x2": ["strategy=deepspeed", "strategy.stage=2", "hw.devices_per_node=2", "trainer.micro_batch_size=4"],
    "megatron tp2 x2": ["strategy=megatron", "strategy.tp=2", "hw.devices_per_node=2", "trainer.micro_batch_size=8"],
    "megatron pp2 x2": [
        "strategy=megatron",
        "strategy.pp=2",
        "strategy.microbatches=2",
        "hw.devices_per_node=2",
        "trainer.micro_batch_size=4",
    ],
}
# (name, source run, step of its checkpoint, layout resumed under): in dependency order.
RESUMES = [
    ("ddp->fsdp, 2->4", "reference", 1, "fsdp x4"),
    ("fsdp->ddp, 4->1", "ddp->fsdp, 2->4", 2, "ddp x1"),
    ("fsdp->megatron tp2", "ddp->fsdp, 2->4", 2, "megatron tp2 x2"),
    ("ddp->megatron pp2, 1->2", "fsdp->ddp, 4->1", 3, "megatron pp2 x2"),
    ("megatron pp2->ddp", "ddp->megatron pp2, 1->2", 4, "ddp x2"),
    ("ddp->deepspeed-3", "reference", 1, "deepspeed-3 x2"),
    ("deepspeed-3->deepspeed-2", "ddp->deepspeed-3", 2, "deepspeed-2 x2"),
    ("deepspeed-2->fsdp", "deepspeed-3->deepspeed-2", 3, "fsdp x2"),
]


CONSOLE = "console.txt"  # what a run printed, kept beside it by ``run``


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step{step:06d}.ckpt"


def run(tmp: Path, name: str, args: list[str]) -> Path:
    run_dir = tmp / name
    result = run_cli([*args, f"hydra.run.dir={run_dir}"], cwd=tmp)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run_dir / CONSOLE).write_text(result.stdout + result.stderr)
    return run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (its own fixture so the elastic test below needs only it, not the whole chain)."""
    return run(tmp_path_factory.mktemp("universal"), "reference", [*COMMON, *LAYOUTS["ddp x2"]])


@pytest.fixture(scope="module")
def runs(reference: Path) -> dict[str, Path]:
    tmp = reference.parent
    done = {"reference": reference}
    for index, (name, source, step, layout) in enumerate(RESUMES):
        # A layout's options replace the source's: the resumed run re-composes the source's recorded overrides.
        done[name] = run(tmp, f"r{index}", [f"resume={checkpoint(done[source], step)}", *LAYOUTS[layout]])
    return done


@pytest.mark.parametrize("name", [name for name, *_ in RESUMES])
def test_resume_continues_the_uninterrupted_losses(name: str, runs: dict[str, Path]) -> None:
    _, _, step, layout = next(r for r in RESUMES if r[0] == name)
    reference, losses = train_losses(runs["reference"]), train_losses(runs[name])
    assert sorted(losses) == list(range(step, STEPS)), f"{name}: steps {sorted(losses)}"
    worst = max(abs(losses[s] - reference[s]) for s in losses)
    assert worst <= 1e-4, f"{name}: max |loss - uninterrupted| = {worst:.2e}"
    manifest = read_manifest(runs[name])
    assert manifest["config"]["strategy"]["name"] == LAYOUTS[layout][0].split("=")[1]
    assert manifest["world"]["world_size"] == int(layout.rsplit("x", 1)[1])


def test_zero3_keeps_its_persistent_parameters_whole_as_the_planner_predicts(runs: dict[str, Path]) -> None:
    """Under the default persistence threshold (1e5 elements: here every tensor) ZeRO-3 keeps each parameter whole on
    every rank beside its partition: the state the run counted is the planner's, persistent parameters included."""
    run_dir = runs["ddp->deepspeed-3"]
    layout = Layout("deepspeed", dp=2, zero_stage=3)
    planned = planned_state_bytes(run_dir, layout)
    assert training_state_bytes(run_dir) == pytest.approx(planned, abs=64)
    assert planned > planned_state_bytes(run_dir, dataclasses.replace(layout, persistence_threshold=0))


@pytest.mark.parametrize("name", [name for name, *_ in RESUMES])
def test_optimizer_state_is_carried_over(name: str, runs: dict[str, Path]) -> None:
    """Adam's step count in the final checkpoint is the run's whole step count, not the steps since the resume."""
    state = load_checkpoint(checkpoint(runs[name], STEPS))
    assert state["global_step"] == STEPS
    steps = {float(v) for k, v in state["optimizer_0"].items() if k.startswith("state.") and k.endswith(".step")}
    assert steps == {float(STEPS)}, f"{name}: Adam step counts {steps}"
    moments = [v for k, v in state["optimizer_0"].items() if k.endswith(".exp_avg_sq")]
    assert moments and all(float(m.abs().sum()) > 0 for m in moments)


def test_checkpoint_names_are_single_process_names_whatever_wrote_them(runs: dict[str, Path]) -> None:
    expected = sorted(load_checkpoint(checkpoint(runs["reference"], STEPS))["state_dict"])
    assert "model.blocks.1.attn.wq.weight" in expected and "model.lm_head.weight" in expected
    for name in ("ddp->fsdp, 2->4", "ddp->deepspeed-3", "ddp->megatron pp2, 1->2", "fsdp->megatron tp2"):
        assert sorted(load_checkpoint(checkpoint(runs[name], STEPS))["state_dict"]) == expected, name


def test_a_world_size_change_is_said_once_and_reseeds(runs: dict[str, Path]) -> None:
    changed = (runs["fsdp->ddp, 4->1"] / CONSOLE).read_text()
    assert changed.count("the checkpoint holds RNG states of 4 ranks but this run has 1") == 1
    assert "re-seeded from (trainer.seed, step, rank)" in changed
    grown = (runs["ddp->fsdp, 2->4"] / CONSOLE).read_text(), (runs["ddp->megatron pp2, 1->2"] / CONSOLE).read_text()
    assert "RNG states of 2 ranks but this run has 4" in grown[0]
    assert grown[1].count("RNG states of 1 ranks but this run has 2") == 1
    assert "RNG states" not in (runs["megatron pp2->ddp"] / CONSOLE).read_text()  # same world: RNG carried as is


def test_resume_weights_only_starts_the_optimizer_afresh(runs: dict[str, Path], tmp_path: Path) -> None:
    source = checkpoint(runs["reference"], 4)
    resumed = run(tmp_path, "weights", [f"resume={source}", "resume_weights_only=true", *LAYOUTS["ddp x1"]])
    assert (resumed / CONSOLE).read_text().count("the optimizer state (Adam's moments and step counts) starts") == 1
    state = load_checkpoint(checkpoint(resumed, STEPS))
    steps = {float(v) for k, v in state["optimizer_0"].items() if k.startswith("state.") and k.endswith(".step")}
    assert state["global_step"] == STEPS and steps == {float(STEPS - 4)}  # Adam counted only the steps since
    losses, reference = train_losses(resumed), train_losses(runs["reference"])
    assert sorted(losses) == [4, 5]
    # The weights were resumed (the first step's loss is the uninterrupted one: computed before any update) ...
    assert losses[4] == pytest.approx(reference[4], abs=1e-4)
    # ... and fresh moments make a different update from the second step on.
    assert abs(losses[5] - reference[5]) > 1e-4


def test_export_writes_one_file_the_single_process_model_loads(runs: dict[str, Path]) -> None:
    """``python -m train export=<run>`` on a run DeepSpeed, then FSDP wrote: the model's own names, same values."""
    import torch

    from disttrain.config.schema import ModelConfig
    from disttrain.models import build_model

    source = runs["deepspeed-2->fsdp"]
    result = run_cli([f"export={source}"], cwd=source)
    out = source / "export" / f"step{STEPS:06d}.pt"
    assert result.returncode == 0 and result.stdout.strip() == f"exported {out}", result.stderr[-2000:]
    assert result.stderr == ""
    weights = torch.load(out, weights_only=True)
    model = build_model(ModelConfig(**read_manifest(source)["config"]["model"]), seed=1, device="cpu")
    assert not model.load_state_dict(weights).missing_keys
    saved = load_checkpoint(checkpoint(source, STEPS))["state_dict"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[f"model.{name}"]), name
    again = run_cli([f"export={source}"], cwd=source)
    assert again.returncode == 2 and "export_to: " in again.stderr  # never written over


def cluster_env(rank: int, world: int, port: int, restart: int) -> dict[str, str]:
    """What torchrun sets in each worker it starts (``--nnodes=1:2``, one node): no rendezvous needed to test what
    the job does with it, and the kill and the restart stay in the test's hands."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISTTRAIN_", "SLURM_", "TORCHELASTIC_"))}
    return {
        **env,
        "PYTHONUNBUFFERED": "1",
        "HYDRA_FULL_ERROR": "0",
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "elastic-test",
        "TORCHELASTIC_RESTART_COUNT": str(restart),
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_elastic_restart_on_fewer_ranks_resumes_at_the_same_global_batch(reference: Path, tmp_path: Path) -> None:
    """Attempt 0: torchrun starts 2 workers, rank 0 is SIGKILLed after step 3 and the agent ends rank 1. Attempt 1
    (restart 1) finds one worker: it resumes the run dir's step-3 checkpoint on 1 rank at the global batch of 8
    (accumulation 2), continues the uninterrupted run's losses, and run.json lists both attempts' worlds."""
    run_dir, killed_after = tmp_path / "elastic", 3
    args = [sys.executable, "-m", "train", *COMMON, *LAYOUTS["ddp x2"], f"hydra.run.dir={run_dir}"]
    port, fault = free_port(), {"DISTTRAIN_FAULT": f"sigkill@step={killed_after},rank=0"}
    logs = [(tmp_path / f"attempt0_rank{rank}.txt").open("w") for rank in (0, 1)]  # rank 1 dies loudly
    workers = [
        subprocess.Popen(args, cwd=tmp_path, env={**cluster_env(rank, 2, port, 0), **fault}, stdout=log, stderr=log)
        for rank, log in enumerate(logs)
    ]
    try:
        code = workers[0].wait(timeout=300)
        assert code == -signal.SIGKILL, (tmp_path / "attempt0_rank0.txt").read_text()[-3000:]
        try:  # rank 1 may notice its peer's death itself; else the agent ends it, as torchrun's does
            workers[1].wait(timeout=10)
        except subprocess.TimeoutExpired:
            workers[1].kill()
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        for log in logs:
            log.close()
    newest = checkpoint(run_dir, killed_after)
    assert newest.exists() and not checkpoint(run_dir, killed_after + 1).exists()

    # The restart runs the same command (the config still says 2 ranks) on the one worker the launcher found.
    env = {**cluster_env(0, 1, free_port(), 1), **fault}  # the fault strikes attempt 0 only
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    note = (
        "elastic restart: the launcher started 1 ranks (the run had 2); training on 1 x 1 at the same global batch "
        "8 = micro 4 x dp 1 x accumulation 2"
    )
    assert out.count(note) == 1, out[-3000:]
    assert out.count(f"restart 1: resuming from {newest}") == 1, out[-3000:]

    manifest = read_manifest(run_dir)
    assert manifest["status"] == "completed" and manifest["restart_attempt"] == 1
    assert manifest["resumed_from"] == str(newest)
    assert manifest["attempts"] == [
        {"attempt": 0, "world_size": 2, "global_batch": 8, "accumulation": 1},
        {"attempt": 1, "world_size": 1, "global_batch": 8, "accumulation": 2},
    ]
    assert manifest["world"]["world_size"] == 1 and manifest["batch"]["accumulation"] == 2

    # The restart trains the steps after the checkpoint, continuing the uninterrupted 2-rank run to 1e-4 (attempt
    # 0's metrics, kept beside them, are that run's too).
    losses, expected = train_losses(run_dir), train_losses(reference)
    assert sorted(losses) == list(range(killed_after, STEPS))
    with (run_dir / "metrics" / "metrics_attempt0.csv").open() as handle:
        first = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(handle) if r["train/loss"]}
    assert first and set(first) <= set(range(killed_after))
    worst = max(abs(loss - expected[s]) for s, loss in [*losses.items(), *first.items()])
    assert worst <= 1e-4, f"max |loss - uninterrupted| = {worst:.2e}"
    state = load_checkpoint(checkpoint(run_dir, STEPS))
    steps = {float(v) for k, v in state["optimizer_0"].items() if k.startswith("state.") and k.endswith(".step")}
    assert state["global_step"] == STEPS and steps == {float(STEPS)}  # Adam's state came through the restart
