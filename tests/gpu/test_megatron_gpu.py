"""strategy=megatron on CUDA/NCCL (skipped without CUDA by tests/conftest.py).

One GPU runs the whole engine path (FSDP2 bf16 policy, selective recomputation, manual optimization) at
tp = pp = 1; two or more GPUs run tensor and pipeline parallelism over NCCL.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import read_manifest, run_cli
from tests.gpu.test_cuda_runs import LEARNED, SHORT

pytestmark = pytest.mark.gpu


def test_one_gpu_megatron_engine_learns(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["hw=1xa100", "hw.devices_per_node=1", "strategy=megatron", "strategy.activation_checkpointing=selective"]
    result = run_cli([*args, "precision=bf16-mixed", *SHORT, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_manifest(run_dir)["result"]["val_loss"] < LEARNED


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL tensor/pipeline parallelism")
@pytest.mark.parametrize("layout", [["strategy.tp=2", "strategy.sequence_parallel=true"], ["strategy.pp=2"]])
def test_two_gpu_tensor_and_pipeline_parallel(layout: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["hw=1xa100", "hw.devices_per_node=2", "strategy=megatron", *layout, "precision=bf16-mixed", *SHORT]
    result = run_cli([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_manifest(run_dir)["result"]["val_loss"] < LEARNED
