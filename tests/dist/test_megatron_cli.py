"""The full 3D layout (dp=2 x pp=2 x tp=2, 8 gloo processes) through ``python -m train``: the same losses as one
process, a resumed run that continues exactly (same losses, bitwise-equal weights), and the same checkpoint
resumed on another layout (2 processes, tp=2) continuing with the same losses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import read_manifest, run_cli
from tests.dist.test_parity_and_resume import COMMON as PARITY_COMMON
from tests.dist.test_parity_and_resume import model_weights, run, train_losses

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 10
# The 2-rank parity tests' settings, over 10 steps with a checkpoint at step 5 and no diagnostics.
COMMON = [
    *(arg for arg in PARITY_COMMON if not arg.startswith(("trainer.max_steps=", "trainer.ckpt_every_n_steps="))),
    f"trainer.max_steps={STEPS}",
    "trainer.ckpt_every_n_steps=5",
    "diagnostics=off",
]
# 2 data-parallel ranks x micro 2 x 2 pipeline micro-batches = the 8 samples per step of one process x micro 8.
THREE_D = ["strategy=megatron", "strategy.tp=2", "strategy.pp=2", "hw.devices_per_node=8", "trainer.micro_batch_size=2"]


@pytest.fixture(scope="module")
def three_d(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("megatron")
    result = run_cli([*COMMON, *THREE_D, f"hydra.run.dir={tmp / '3d'}"], cwd=tmp)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # Gradient norms over dp_shard x tp take one all-reduce on the flattened axes: DTensor has nothing to warn.
    assert "sequential all_reduce" not in result.stderr
    return tmp / "3d"


def test_3d_run_matches_one_process_and_resumes_exactly(three_d: Path, tmp_path: Path) -> None:
    reference = train_losses(run(tmp_path, "single", [*COMMON, "hw.devices_per_node=1", "trainer.micro_batch_size=8"]))
    full = three_d
    losses = train_losses(full)
    assert sorted(losses) == list(range(STEPS)) == sorted(reference)
    worst = max(abs(losses[s] - reference[s]) for s in range(STEPS))
    assert worst <= 1e-4, f"dp2 x pp2 x tp2: max |loss - one process| = {worst:.2e}"
    assert losses[STEPS - 1] < losses[0] - 0.5  # it learned: parity is not two flat lines

    mid = full / "checkpoints" / "step000005.ckpt"
    resumed = run(tmp_path, "resumed", [f"resume={mid}"])
    assert read_manifest(resumed)["config"]["strategy"]["tp"] == 2
    resumed_losses = train_losses(resumed)
    assert sorted(resumed_losses) == list(range(5, STEPS))
    for step in range(5, STEPS):
        assert resumed_losses[step] == pytest.approx(losses[step], abs=1e-6)
    expected = model_weights(full / "checkpoints" / f"step0000{STEPS}.ckpt")
    actual = model_weights(resumed / "checkpoints" / f"step0000{STEPS}.ckpt")
    # Parameter names are the single-process names whatever the layout (blocks by global layer id).
    assert "model.blocks.3.attn.wq.weight" in expected and sorted(expected) == sorted(actual)
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), f"{name} differs after resume"


def test_3d_checkpoint_resumes_on_another_layout(three_d: Path, tmp_path: Path) -> None:
    """Checkpoints hold single-process parameter names, so torch.distributed.checkpoint reshards them on load:
    dp2 x pp2 x tp2 (8 processes) continues as tp2 on 2 processes at the same global batch of 8."""
    full = three_d
    losses = train_losses(full)
    two = ["strategy=megatron", "strategy.tp=2", "strategy.pp=1", "hw.devices_per_node=2"]
    batch = ["trainer.micro_batch_size=4", "trainer.global_batch_size=8"]  # 4 x dp 1 x 2 micro-batches
    resumed = run(tmp_path, "tp2", [f"resume={full / 'checkpoints' / 'step000005.ckpt'}", *two, *batch])
    strategy = read_manifest(resumed)["config"]["strategy"]
    assert (strategy["tp"], strategy["pp"]) == (2, 1)
    resumed_losses = train_losses(resumed)
    assert sorted(resumed_losses) == list(range(5, STEPS))
    worst = max(abs(resumed_losses[s] - losses[s]) for s in range(5, STEPS))
    assert worst <= 1e-4, f"3D checkpoint resumed as tp2: max |loss - 3D run| = {worst:.2e}"
