"""precision=fp8 (torchao float8 training) on a GPU with fp8 tensor cores: it trains, alone, compiled and under
FSDP2 with fp8 all-gathers (skipped without CUDA; refused before launch on GPUs older than compute capability 8.9)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import read_manifest, run_cli
from tests.gpu.test_cuda_runs import LEARNED, SHORT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability(0) < (8, 9), reason="needs fp8 tensor cores"
    ),
]


@pytest.mark.parametrize(
    "overrides",
    [
        ["strategy=ddp", "precision.recipe=tensorwise"],
        ["strategy=ddp", "precision.recipe=rowwise"],
        ["strategy=fsdp", "precision.recipe=tensorwise"],  # the weights all-gathered in fp8
        ["strategy=ddp", "precision.recipe=tensorwise", "precision.fp8_head=true"],  # the tied LM head in fp8 too
    ],
    ids=["ddp-tensorwise", "ddp-rowwise", "fsdp-tensorwise", "ddp-tensorwise-head"],
)
def test_fp8_runs_learn(overrides: list[str], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # An fp8 hw profile (H100's peaks; the planner's numbers do not matter here) on this one GPU.
    args = ["hw=8xh100", "hw.devices_per_node=1", "precision=fp8", *SHORT, *overrides, f"hydra.run.dir={run_dir}"]
    result = run_cli(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = read_manifest(run_dir)
    assert manifest["config"]["model"]["compile"] is True  # model.compile=null compiles on a GPU
    assert manifest["result"]["val_loss"] < LEARNED
