"""Real 2-process gloo runs through the CLI: loss parity with one process, and exact resume.

Each run is a separate ``python -m train`` process tree, so Lightning and torch.distributed state never leaks
between tests.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from disttrain.launch.console import IMPORT_CHATTER
from tests.conftest import load_checkpoint, read_manifest, run_cli

pytestmark = pytest.mark.dist

STEPS = 20


def train_losses(run_dir: Path) -> dict[int, float]:
    """Per-step global-batch train loss as logged (metrics.csv `step` is the 0-based optimizer step)."""
    with (run_dir / "metrics" / "metrics.csv").open() as handle:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(handle) if row["train/loss"]}


def run(tmp: Path, name: str, args: list[str]) -> Path:
    run_dir = tmp / name
    result = run_cli([*args, f"hydra.run.dir={run_dir}"], cwd=tmp)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert read_manifest(run_dir)["status"] == "completed"
    chatter = [f for fragments in IMPORT_CHATTER.values() for f in fragments if f in result.stdout + result.stderr]
    assert not chatter, f"{name}: libraries' import-time lines on the console: {chatter}"
    return run_dir


@pytest.fixture(scope="module")
def single_process_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("reference")
    args = [*COMMON, "hw.devices_per_node=1", "trainer.micro_batch_size=8", *UNDIAGNOSED]
    return train_losses(run(tmp, "single", args))


COMMON = [
    # gpt-nano's 4 blocks (pipeline stages and block names need them) at a third of its width: a ninth of its step.
    "model.d_model=64",
    "model.n_heads=4",
    "model.ffn_hidden=256",
    "data.num_train_tokens=65536",
    "data.num_val_tokens=8192",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.val_every_n_steps=1000",
    "trainer.val_batches=1",
    "trainer.ckpt_every_n_steps=10",
    "optimizer.warmup_steps=2",
    # A gentler lr than the default: Adam turns rounding-level gradient differences (a different summation
    # order across ranks) into full-size updates, and at 3e-3 this small model's loss landscape amplifies them
    # past 1e-4 within 20 steps.
    "optimizer.lr=1e-3",
    "precision=fp32",
]


LAYOUTS = {
    "ddp": ["strategy=ddp", "trainer.micro_batch_size=4"],
    "fsdp": ["strategy=fsdp", "trainer.micro_batch_size=4"],
    # 2 ranks x micro 2 x 2 accumulated micro-batches: the same 8 samples per step.
    "ddp-accumulation": ["strategy=ddp", "trainer.micro_batch_size=2", "trainer.global_batch_size=8"],
    "fsdp-activation-checkpointing": [
        "strategy=fsdp",
        "strategy.activation_checkpointing=true",
        "trainer.micro_batch_size=4",
    ],
    # HSDP with 2 replica groups of 1: each rank keeps whole parameters, gradients all-reduced across groups.
    "fsdp-hybrid": ["strategy=fsdp", "strategy.dp_replicate=2", "trainer.micro_batch_size=4"],
}


# The parity runs assert nothing about diagnostics, so they run without (a launch ~2.5 s shorter); the DDP and FSDP
# runs and their resumes keep them on: start-up calibration (the FSDP probe's copy of the model included) and the
# step records must change neither the losses nor the bitwise resume.
UNDIAGNOSED = ["diagnostics=off"]
DIAGNOSED = {"ddp", "fsdp"}


class LayoutRuns:
    """Each layout's 20-step run, made once per module: the parity test and the resume test share it."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.done: dict[str, Path] = {}

    def __getitem__(self, layout: str) -> Path:
        if layout not in self.done:
            args = [*COMMON, *LAYOUTS[layout], *([] if layout in DIAGNOSED else UNDIAGNOSED)]
            self.done[layout] = run(self.factory.mktemp(layout), layout, args)
        return self.done[layout]


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory: pytest.TempPathFactory) -> LayoutRuns:
    return LayoutRuns(tmp_path_factory)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_ranks_match_one_process(
    layout: str, single_process_reference: dict[int, float], layout_runs: LayoutRuns
) -> None:
    """2 ranks see the same samples per step as 1 process x micro 8: the same losses for 20 steps."""
    strategy = layout
    losses = train_losses(layout_runs[layout])
    assert sorted(losses) == list(range(STEPS)) == sorted(single_process_reference)
    worst = max(abs(losses[s] - single_process_reference[s]) for s in range(STEPS))
    assert worst <= 1e-4, f"{strategy}: max |loss - reference| = {worst:.2e}"
    # The run really learned something, so parity is not two flat lines.
    assert losses[STEPS - 1] < losses[0] - 0.5


def model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Model tensors of a checkpoint (any strategy: one layout), by single-process name."""
    state = load_checkpoint(checkpoint)["state_dict"]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and "model" in k}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_from_mid_run_checkpoint_ends_with_identical_weights(
    strategy: str, layout_runs: LayoutRuns, tmp_path: Path
) -> None:
    uninterrupted = layout_runs[strategy]  # the parity test's run of this strategy (checkpoints at 10 and 20)
    mid = uninterrupted / "checkpoints" / "step000010.ckpt"
    resumed = run(tmp_path, "resumed", [f"resume={mid}"])
    # The resumed run took its configuration from the original run's recorded overrides.
    assert read_manifest(resumed)["config"]["strategy"]["name"] == strategy
    assert read_manifest(resumed)["resumed_from"] == str(mid.resolve())
    # Diagnostics (calibration included) ran on both legs of the DDP and FSDP resumes.
    assert (uninterrupted / "calibration.json").is_file() == (strategy in DIAGNOSED)
    assert (resumed / "calibration.json").is_file() == (strategy in DIAGNOSED)

    full_losses, resumed_losses = train_losses(uninterrupted), train_losses(resumed)
    assert sorted(resumed_losses) == list(range(10, STEPS))
    for step in range(10, STEPS):
        assert resumed_losses[step] == pytest.approx(full_losses[step], abs=1e-6)

    expected = model_weights(uninterrupted / "checkpoints" / f"step0000{STEPS}.ckpt")
    actual = model_weights(resumed / "checkpoints" / f"step0000{STEPS}.ckpt")
    assert expected and sorted(expected) == sorted(actual)
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), f"{name} differs after resume"
    assert (resumed / "checkpoints" / "last.ckpt").resolve().name == f"step0000{STEPS}.ckpt"


def test_the_fsdp_probe_timed_the_runs_own_model_sharded_as_the_run_shards_it(layout_runs: LayoutRuns) -> None:
    """The diagnosed FSDP run: every rank timed a one-block copy of the run's model plain and under fully_shard (the
    block's unit and the root), and the per-byte cost the planner charges FSDP2's copies is that difference less the
    two modules' hooks, over the bytes the planner counts for that copy."""
    import dataclasses
    import json
    import statistics

    from diagnostics.telemetry import telemetry_path
    from disttrain.planner import Layout, Workload, comm_plan, model_shape
    from tests.conftest import hw_profile, model_preset

    run_dir = layout_runs["fsdp"]
    probe = dataclasses.replace(model_preset("gpt-nano"), d_model=64, n_heads=4, ffn_hidden=256, n_layers=1)
    work = Workload(global_batch_size=8, micro_batch_size=4, seq_len=probe.seq_len, precision="fp32")
    copied = comm_plan(model_shape(probe), Layout("fsdp", dp=2), work, hw_profile("cpu")).mb_fsdp_copy_bytes
    per_byte = []
    for rank in (0, 1):
        records = [json.loads(line) for line in telemetry_path(run_dir, rank).read_text().splitlines()]
        (record,) = [r for r in records if r["kind"] == "fsdp_calibration"]
        assert (record["probe"], record["ranks"], record["modules"], record["tokens"]) == ("model", 2, 2, 4 * 128)
        # Sharded over 2 ranks its units pad each tensor's rows to even: the planner counts those padded shards.
        assert record["copy_bytes"] == pytest.approx(copied, rel=0.01)
        assert record["sharded_model_s"] > 0 and record["plain_model_s"] > 0
        assert set(record["overhead_s"]) == {"16"}  # the Linear pair's per-byte width is not run beside it
        net = record["model_extra_s"] - 2 * record["fixed_us"] * 1e-6
        assert record["ns_per_byte"] == pytest.approx(max(0.0, net) / record["copy_bytes"] * 1e9)
        per_byte.append(record["ns_per_byte"])
    calibration = json.loads((run_dir / "calibration.json").read_text())
    assert calibration["fsdp_copy_ns_per_byte"] == pytest.approx(statistics.median(per_byte))
    assert read_manifest(run_dir)["prediction"]["basis"]["fsdp_copy_ns_per_byte"] == "measured"
