"""The MoE layer on a GPU: routing, counters kept on the device, bf16 training (skipped without CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from disttrain.models.moe import moe_layers
from disttrain.models.transformer import build_model
from tests.conftest import model_preset, read_manifest, run_cli

pytestmark = pytest.mark.gpu


def test_moe_forward_backward_on_cuda_counts_on_the_device() -> None:
    cfg = model_preset("moe-micro")
    model = build_model(cfg, seed=0, device="cuda")
    tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(tokens).float().pow(2).mean()
    loss.backward()
    layer = moe_layers(model)[0]
    assert layer.tokens_per_expert.device.type == "cuda"
    routed, dropped = layer.take_counts()
    assert sum(routed) == 4 * cfg.seq_len * cfg.top_k and dropped == [0] * cfg.num_experts
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_moe_trains_under_fsdp_on_one_gpu(tmp_path: Path) -> None:
    args = ["model=moe-micro", "strategy=fsdp", "hw=1xa100", "hw.devices_per_node=1", "precision=bf16-mixed"]
    args += ["trainer.max_steps=30", "trainer.ckpt_every_n_steps=0", f"hydra.run.dir={tmp_path / 'run'}"]
    result = run_cli(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_manifest(tmp_path / "run")["status"] == "completed"
