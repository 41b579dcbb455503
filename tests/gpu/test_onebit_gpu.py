"""optimizer=onebit_adam on CUDA: the optimizer path on one GPU (its compression runs there, with no one to exchange
with), and the compressed exchange over NCCL on two; skipped without a GPU.

The exchange, its bytes, convergence and an exact resume are proven on 2 gloo ranks (tests/dist/test_comm_hooks.py);
here the same kernels (sign packing in uint8, the all-to-all and all-gather of bytes) meet CUDA and NCCL.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from disttrain.strategies.onebit import state_path
from tests.conftest import load_checkpoint, read_manifest, run_cli
from tests.gpu.test_cuda_runs import LEARNED, SHORT

pytestmark = pytest.mark.gpu

ONEBIT = ["optimizer=onebit_adam", "optimizer.freeze_steps=40", "precision=bf16-mixed"]
ONEBIT += ["trainer.ckpt_every_n_steps=100"]


def losses(run_dir: Path) -> dict[int, float]:
    with (run_dir / "metrics" / "metrics.csv").open() as handle:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")}


def train_resume_and_compare(devices: int, tmp_path: Path) -> None:
    args = ["hw=1xa100", f"hw.devices_per_node={devices}", *ONEBIT, *SHORT]
    full = tmp_path / "full"
    result = run_cli([*args, f"hydra.run.dir={full}"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert read_manifest(full)["result"]["val_loss"] < LEARNED
    mid = full / "checkpoints" / "step000100.ckpt"
    assert all(state_path(mid, rank).is_file() for rank in range(devices))  # each rank's error feedback
    resumed = tmp_path / "resumed"
    result = run_cli([f"resume={mid}", f"hydra.run.dir={resumed}"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # Compressed steps continue where they stopped: the same losses as the uninterrupted run (GPU kernels may differ
    # in the last bits between processes, so within bf16's resolution rather than bit for bit).
    full_losses, resumed_losses = losses(full), losses(resumed)
    assert min(resumed_losses) > 100
    for step, loss in resumed_losses.items():
        assert loss == pytest.approx(full_losses[step], abs=2e-2), step
    expected = load_checkpoint(full / "checkpoints" / "step000150.ckpt")["state_dict"]
    actual = load_checkpoint(resumed / "checkpoints" / "step000150.ckpt")["state_dict"]
    for name, tensor in expected.items():
        assert torch.allclose(tensor.float(), actual[name].float(), atol=1e-2), name


def test_onebit_adam_trains_and_resumes_on_one_gpu(tmp_path: Path) -> None:
    train_resume_and_compare(1, tmp_path)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
def test_onebit_adam_over_nccl(tmp_path: Path) -> None:
    train_resume_and_compare(2, tmp_path)
