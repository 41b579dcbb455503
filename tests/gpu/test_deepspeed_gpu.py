"""strategy=deepspeed on CUDA (NCCL, DeepSpeed's bf16 path, its CPU Adam under offload); skipped without a GPU.

The one-GPU cases ran on an H200 (benchmarks/RESULTS.md, "GPU runs"); the NCCL case needs two GPUs and has not run. The
CPU (gloo) paths are proven in tests/dist/test_deepspeed.py.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import read_manifest, run_cli
from tests.gpu.test_cuda_runs import LEARNED, SHORT

pytestmark = pytest.mark.gpu


def train_and_check(args: list[str], tmp_path: Path, stage: int = 2) -> dict:
    run_dir = tmp_path / "run"
    result = run_cli([*args, *SHORT, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    manifest = read_manifest(run_dir)
    assert manifest["strategy_resolved"]["name"] == "deepspeed"
    with (run_dir / "metrics" / "metrics.csv").open() as handle:
        losses = [float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")]
    assert losses[-1] < losses[0] - 0.5, losses  # it trains, not only runs
    assert manifest["result"]["val_loss"] < LEARNED
    # The universal layout every strategy writes (full tensors under single-process names), with the strategy's
    # record of the ZeRO stage that wrote it.
    final = run_dir / "checkpoints" / "step000150.ckpt" / "meta.pt"
    assert torch.load(final, weights_only=True)["disttrain_checkpoint"]["zero_stage"] == stage
    return manifest


def test_zero2_bf16_trains_on_one_gpu(tmp_path: Path) -> None:
    train_and_check(["hw=1xa100", "hw.devices_per_node=1", "strategy=deepspeed", "precision=bf16-mixed"], tmp_path)


def test_zero3_optimizer_offload_trains_on_one_gpu(tmp_path: Path) -> None:
    """Offload steps the host partition with DeepSpeedCPUAdam, whose op DeepSpeed compiles at launch."""
    args = ["hw=1xa100", "hw.devices_per_node=1", "strategy=deepspeed", "strategy.stage=3", "precision=bf16-mixed"]
    train_and_check([*args, "strategy.offload_optimizer=true"], tmp_path, stage=3)


def test_zero_infinity_nvme_offload_trains_on_one_gpu(tmp_path: Path) -> None:
    """ZeRO-Infinity: optimizer states and parameter partitions swapped to a directory through DeepSpeed's async I/O
    op (libaio, compiled at launch); the run swaps in its own folder under nvme_path and removes it at the end,
    leaving whatever else the directory holds."""
    # DeepSpeed's async I/O opens its swap files with O_DIRECT, which tmpfs refuses: DISTTRAIN_NVME_DIR names a
    # directory on a real drive where /tmp is not one.
    nvme = Path(os.environ.get("DISTTRAIN_NVME_DIR", tmp_path)) / f"nvme-{tmp_path.name}"
    nvme.mkdir(parents=True)
    (nvme / "other-data.bin").write_bytes(b"keep")
    args = ["hw=1xa100", "hw.devices_per_node=1", "strategy=deepspeed", "strategy.stage=3", "precision=bf16-mixed"]
    args += ["strategy.offload_optimizer=nvme", "strategy.offload_params=nvme", f"strategy.nvme_path={nvme}"]
    manifest = train_and_check(args, tmp_path, stage=3)
    assert manifest["config"]["strategy"]["offload_optimizer"] == "nvme"
    assert sorted(p.name for p in nvme.iterdir()) == ["other-data.bin"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
def test_zero2_bf16_over_nccl(tmp_path: Path) -> None:
    args = ["hw=1xa100", "hw.devices_per_node=2", "strategy=deepspeed", "precision=bf16-mixed"]
    assert train_and_check(args, tmp_path)["world"]["world_size"] == 2
