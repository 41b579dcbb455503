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


@pytest.mark.parametrize("model", ["moe-micro", "hf-tiny-mixtral"])
def test_moe_trains_under_fsdp_on_one_gpu(model: str, tmp_path: Path) -> None:
    """The built-in MoE and transformers' Mixtral (its fused experts run by the project's layer), bf16 FSDP2."""
    args = [f"model={model}", "strategy=fsdp", "hw=1xa100", "hw.devices_per_node=1", "precision=bf16-mixed"]
    # An HF model's run ends by exporting its last checkpoint (hf_model/): one at the end, none before.
    args += ["trainer.max_steps=30", "trainer.ckpt_every_n_steps=30", f"hydra.run.dir={tmp_path / 'run'}"]
    result = run_cli(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_manifest(tmp_path / "run")["status"] == "completed"
    if model.startswith("hf-"):
        assert (tmp_path / "run" / "hf_model" / "config.json").is_file()


def test_grouped_gemm_is_the_h100_path_and_matches_the_loop() -> None:
    """On an H100/H200 in bf16 the experts run as one grouped GEMM per projection; same values as the loop."""
    from disttrain.models.moe import GroupedExperts, grouped_gemm_fits

    cfg = model_preset("moe-micro")
    experts = GroupedExperts(cfg, 4).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.1)
    counts = [40, 0, 72, 16]
    x = torch.randn(sum(counts), cfg.d_model, device="cuda", dtype=torch.bfloat16)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert grouped_gemm_fits(x, list(experts.parameters()))
    outs = []
    for grouped in (False, True):
        experts.grouped_gemm = grouped
        experts.zero_grad()
        out = experts(x, counts)
        out.float().square().mean().backward()
        outs.append([out, *(p.grad.clone() for p in experts.parameters())])
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    assert all(torch.count_nonzero(p.grad[1]) == 0 for p in experts.parameters())


def _losses(run_dir: Path) -> dict[int, float]:
    import csv

    with (run_dir / "metrics" / "metrics.csv").open() as handle:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(handle) if r["train/loss"]}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL all-to-all")
@pytest.mark.parametrize("model", ["moe-micro", "hf-tiny-mixtral"])
def test_expert_parallel_all_to_all_over_nccl_matches_one_gpu(model: str, tmp_path: Path) -> None:
    """ep=2 on two GPUs (NCCL all-to-all with uneven splits, counts exchanged on the device) trains what one GPU
    trains, in fp32 (the tolerance is the GPUs' reduction order, not bf16's)."""
    common = [f"model={model}", "hw=1xa100", "precision=fp32", "trainer.max_steps=20", "trainer.log_every_n_steps=1"]
    common += ["trainer.ckpt_every_n_steps=0", "trainer.val_every_n_steps=1000", "optimizer.warmup_steps=2"]
    runs = {
        "one": ["strategy=fsdp", "hw.devices_per_node=1", "trainer.micro_batch_size=8"],
        "ep2": ["strategy=fsdp", "strategy.ep=2", "hw.devices_per_node=2", "trainer.micro_batch_size=4"],
    }
    losses = {}
    for name, args in runs.items():
        result = run_cli([*common, *args, f"hydra.run.dir={tmp_path / name}"], cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        losses[name] = _losses(tmp_path / name)
    assert sorted(losses["ep2"]) == sorted(losses["one"]) == list(range(20))
    worst = max(abs(losses["ep2"][s] - losses["one"][s]) for s in losses["one"])
    assert worst < 1e-3, f"{model} at ep=2 over NCCL drifts from one GPU by {worst:.2e}"
