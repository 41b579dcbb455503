"""strategy=deepspeed on 2 gloo ranks through the CLI: ZeRO-1/2/3 loss parity with one process, each rank holding
only its partition, and exact resume from a sharded ZeRO-3 checkpoint.

Every run is one ``python -m train`` process tree (``import deepspeed`` costs seconds per process), so each stage is
a single short job; the shard sizes are read from the record each checkpoint keeps of what every rank held (the
checkpoint itself holds full tensors under single-process names, like every strategy's).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from diagnostics.calibration import calibration_from_telemetry
from diagnostics.telemetry import telemetry_path
from disttrain.config.schema import ModelConfig
from disttrain.models import build_model
from disttrain.planner import Layout, Workload, model_shape, model_state_bytes
from tests.conftest import TINY_MODEL, read_manifest
from tests.dist.test_parity_and_resume import model_weights, run, train_losses

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 6
WORLD = 2
COMMON = [
    *TINY_MODEL,
    "data.num_train_tokens=65536",
    "data.num_val_tokens=8192",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.val_every_n_steps=1000",
    "trainer.val_batches=1",
    "trainer.ckpt_every_n_steps=3",
    "optimizer.warmup_steps=2",
    "optimizer.lr=1e-3",  # see test_parity_and_resume: Adam amplifies summation-order noise at 3e-3
    "precision=fp32",
    "diagnostics=off",
]
# 2 ranks x micro 4 (or micro 2 x 2 accumulated) = the reference's 8 samples per step.
STAGES = {
    # Accumulation: DeepSpeed's engine must not divide the loss by the accumulation a second time.
    1: ["strategy.stage=1", "trainer.micro_batch_size=2", "trainer.global_batch_size=8"],
    # Diagnosed with its start-up calibration: the ZeRO probe builds engines of its own before the run's (at the run's
    # accumulation), which must leave the run's training (parity below) as it was; its figures reach the prediction.
    2: [
        "strategy.stage=2",
        "trainer.micro_batch_size=2",
        "trainer.global_batch_size=8",
        "diagnostics=default",
        "diagnostics.profile=false",
        "diagnostics.report=false",
    ],
    # Threshold 0 partitions every parameter (DeepSpeed keeps ones under 1e5 elements whole by default);
    # activation checkpointing recomputes blocks whose parameters ZeRO-3 gathers again in backward.
    3: [
        "strategy.stage=3",
        "strategy.param_persistence_threshold=0",
        "strategy.activation_checkpointing=true",
        "trainer.micro_batch_size=4",
        # The step records (no profile, calibration or report): ZeRO-3's collectives are timed per phase, and the
        # timing must not change the math (the parity test below runs with it).
        "diagnostics=default",
        "diagnostics.profile=false",
        "diagnostics.calibrate=false",
        "diagnostics.report=false",
    ],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One job per stage and the single-process reference, shared by the tests below."""
    tmp = tmp_path_factory.mktemp("deepspeed")
    done = {"reference": run(tmp, "reference", [*COMMON, "hw.devices_per_node=1", "trainer.micro_batch_size=8"])}
    for stage, args in STAGES.items():
        done[f"zero{stage}"] = run(tmp, f"zero{stage}", [*COMMON, "strategy=deepspeed", *args])
    return done


def group_numels(run_dir: Path) -> tuple[list[int], list[list[int]]]:
    """Per optimizer group (decay, no-decay, as module.param_groups splits them): total and per-parameter numels."""
    cfg = ModelConfig(**read_manifest(run_dir)["config"]["model"])
    model = build_model(cfg, seed=0, device="meta")
    unique = {id(p): p for p in model.parameters()}.values()  # the tied LM head is one parameter
    groups: list[list[int]] = [[p.numel() for p in unique if p.ndim >= 2], [p.numel() for p in unique if p.ndim < 2]]
    return [sum(g) for g in groups], groups


def held_by_ranks(run_dir: Path, step: int) -> tuple[int, list[dict[str, list[int]]]]:
    """The ZeRO stage and what each rank held when the checkpoint was written (recorded in it by the strategy)."""
    writer = torch.load(run_dir / "checkpoints" / f"step{step:06d}.ckpt" / "meta.pt", weights_only=True)
    record = writer["disttrain_checkpoint"]
    return record["zero_stage"], record["ranks"]


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_zero_stage_matches_one_process(stage: int, runs: dict[str, Path]) -> None:
    reference, losses = train_losses(runs["reference"]), train_losses(runs[f"zero{stage}"])
    assert sorted(losses) == list(range(STEPS)) == sorted(reference)
    worst = max(abs(losses[s] - reference[s]) for s in range(STEPS))
    assert worst <= 1e-4, f"ZeRO-{stage}: max |loss - reference| = {worst:.2e}"
    assert losses[STEPS - 1] < losses[0] - 0.2  # it trained: parity is not two flat lines
    assert read_manifest(runs[f"zero{stage}"])["strategy_resolved"]["stage"] == stage


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_2_each_rank_holds_half_of_the_optimizer_state(stage: int, runs: dict[str, Path]) -> None:
    totals, _ = group_numels(runs[f"zero{stage}"])
    zero_stage, ranks = held_by_ranks(runs[f"zero{stage}"], STEPS)
    assert zero_stage == stage and len(ranks) == WORLD
    # Each flat group is padded to a multiple of 2 x world elements, then split evenly over the ranks.
    expected = [math.ceil(n / (2 * WORLD)) * 2 for n in totals]
    for rank, held in enumerate(ranks):
        assert held["fp32_partition"] == expected, f"rank {rank}"
        assert held["params"] == totals, f"rank {rank}"  # stages 1/2 keep whole model parameters
    assert sum(expected) < sum(totals)  # strictly less than a replica's state


def test_zero_2_measures_its_engines_host_work_on_the_runs_model_and_the_planner_charges_it(
    runs: dict[str, Path],
) -> None:
    run_dir = runs["zero2"]
    cfg = ModelConfig(**read_manifest(run_dir)["config"]["model"])
    copy_bytes = 4 * sum(p.numel() for p in build_model(dataclasses.replace(cfg, n_layers=1), seed=0).parameters())
    for rank in range(WORLD):
        lines = telemetry_path(run_dir, rank).read_text().splitlines()
        (record,) = [r for line in lines if (r := json.loads(line)).get("kind") == "zero_calibration"]
        assert record["dp"] == WORLD and record["param_bytes"] == copy_bytes  # a one-block fp32 copy of the model
        assert record["accumulation"] == 2  # the run's micro-batches per step, as the run's engine is driven
        # The engine's hooks and step cost something beyond the plain twin's on tiny linears already.
        assert record["backward_fixed_us"] > 0 and record["step_fixed_us"] > 0, record
        assert record["backward_ns_per_byte"] >= 0 and record["step_ns_per_byte"] >= 0, record
    calibration = calibration_from_telemetry(run_dir)
    assert calibration.zero_backward_fixed_us is not None and calibration.zero_step_ns_per_byte is not None
    model_bytes = 4 * model_shape(cfg).num_parameters
    expected = (
        2 * calibration.zero_backward_fixed_us * 1e-6  # each of the step's two micro-batches
        + 2 * model_bytes * calibration.zero_backward_ns_per_byte * 1e-9
        + calibration.zero_step_fixed_us * 1e-6
        + model_bytes / WORLD * calibration.zero_step_ns_per_byte * 1e-9
    )
    prediction = read_manifest(run_dir)["prediction"]
    assert prediction["predicted"]["zero_host_s"] == pytest.approx(expected) and expected > 0
    assert prediction["basis"]["zero_backward_ns_per_byte"] == "measured"


def test_zero_3_each_rank_holds_only_its_parameter_partitions(runs: dict[str, Path]) -> None:
    totals, per_param = group_numels(runs["zero3"])
    # ZeRO-3 splits every parameter itself: ceil(numel / world) elements of each on every rank.
    expected = [sum(math.ceil(n / WORLD) for n in group) for group in per_param]
    zero_stage, ranks = held_by_ranks(runs["zero3"], STEPS)
    assert zero_stage == 3 and len(ranks) == WORLD
    for rank, held in enumerate(ranks):
        # No rank ever kept whole parameters: its model slice and its fp32 master are its partitions only.
        assert held["params"] == expected, f"rank {rank}"
        assert held["fp32_partition"] == expected, f"rank {rank}"
    assert expected[0] < totals[0] and expected[0] * WORLD >= totals[0]


def training_state_bytes(run_dir: Path, rank: int = 0) -> int:
    """The bytes of parameters, gradients and optimizer states the run counted on ``rank`` (its memory record)."""
    lines = telemetry_path(run_dir, rank).read_text().splitlines()
    (counted,) = [r["training_state_bytes"] for line in lines if (r := json.loads(line)).get("training_state_bytes")]
    return counted


def planned_state_bytes(run_dir: Path, layout: Layout) -> int:
    config = read_manifest(run_dir)["config"]
    shape = model_shape(ModelConfig(**config["model"]))
    workload = Workload(config["trainer"]["micro_batch_size"], 8, shape.seq_len, "fp32")
    memory = model_state_bytes(shape, layout, workload)
    return memory.params + memory.grads + memory.optimizer_states


def test_zero_3_training_state_is_what_the_planner_predicts(runs: dict[str, Path]) -> None:
    """fp32 ZeRO-3 keeps a separate fp32 master partition beside the parameter partition (DeepSpeed copies it even in
    fp32), then momentum, variance and the gradient partition: 20 bytes per partitioned element. A few bytes of
    Adam's step counters apart."""
    layout = Layout("deepspeed", dp=WORLD, zero_stage=3, persistence_threshold=0)
    assert training_state_bytes(runs["zero3"]) == pytest.approx(planned_state_bytes(runs["zero3"], layout), abs=64)


def test_zero_3_collectives_are_timed_inside_forward_backward_and_the_optimizer_step(runs: dict[str, Path]) -> None:
    for rank in range(WORLD):
        lines = (runs["zero3"] / "telemetry" / f"rank{rank:04d}.jsonl").read_text().splitlines()
        steps = [r for line in lines if (r := json.loads(line)).get("kind") == "step"]
        assert steps, f"rank {rank} recorded no steps"
        for record in steps:
            # Every forward all-gathers each block's partitions (and the recomputed backward again): never 0 s.
            assert 0 < record["forward_comm_s"] <= record["forward_s"], (rank, record)
            assert 0 < record["backward_comm_s"] <= record["backward_s"], (rank, record)
            # The step reduces the gradient norm for clipping across the partitions: a wait there is timed too.
            assert 0 < record["optimizer_comm_s"] <= record["optimizer_s"], (rank, record)


def full_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return model_weights(run_dir / "checkpoints" / f"step{step:06d}.ckpt")


def test_zero_3_resume_from_sharded_checkpoint_is_exact(runs: dict[str, Path], tmp_path: Path) -> None:
    uninterrupted = runs["zero3"]
    mid = uninterrupted / "checkpoints" / "step000003.ckpt"
    resumed = run(tmp_path, "resumed", [f"resume={mid}"])
    assert read_manifest(resumed)["config"]["strategy"]["name"] == "deepspeed"
    full_losses, resumed_losses = train_losses(uninterrupted), train_losses(resumed)
    assert sorted(resumed_losses) == list(range(3, STEPS))
    for step in range(3, STEPS):
        assert resumed_losses[step] == pytest.approx(full_losses[step], abs=1e-6)
    expected, actual = full_weights(uninterrupted, STEPS), full_weights(resumed, STEPS)
    assert expected and sorted(expected) == sorted(actual)
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), f"{name} differs after resume"
