"""strategy=megatron trains exactly like one process: every layout of the issue, real gloo processes.

One spawn per world size runs all its layouts in a single process group (tests/dist/megatron_worker.py); the
reference is the whole model trained in this process on the same global batches, with the same init, AdamW
and global-norm clipping.
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, replace

import pytest
import torch
import torch.multiprocessing as mp

from disttrain.config.schema import ModelConfig
from disttrain.models import build_model
from tests.dist.megatron_worker import CLIP, eval_batch, global_batches, optimizer_for, worker
from tests.unit.test_models import GPT_SMALL, LLAMA_SMALL

pytestmark = pytest.mark.dist

TOLERANCE = 1e-4
# The unit tests' small models, with 4 layers (pp x virtual stages up to 4) and a vocabulary tp divides.
# GPT-2 style: learned positions, LayerNorm with bias, GELU, tied embeddings (the tie spans pipeline stages).
GPT = replace(GPT_SMALL, name="gpt-tiny", n_layers=4, vocab_size=64)
# Llama style: RoPE, RMSNorm, SwiGLU, grouped-query attention, untied head.
LLAMA = replace(LLAMA_SMALL, name="llama-tiny", n_layers=4, vocab_size=64)


def reference_losses(model_cfg: ModelConfig) -> tuple[list[float], list[float], float]:
    """Per-step training losses and gradient norms (before clipping) of one process, and the loss of the
    evaluation batch after the last step."""
    torch.manual_seed(0)
    model = build_model(model_cfg, seed=11)
    optimizer = optimizer_for(model)
    losses, norms = [], []
    for inputs, targets in global_batches(model_cfg):
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        losses.append(loss.item())
    inputs, targets = eval_batch(model_cfg)
    with torch.no_grad():
        logits = model(inputs)
        eval_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    return losses, norms, eval_loss.item()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layouts(tmp_path, world: int, model_cfg: ModelConfig, layouts: dict[str, dict]) -> list[dict]:
    # A free port is free only when asked: another test's ranks may bind it before these (spawned, seconds of
    # imports later) do. That one case is retried on a new port; any other failure is the test's.
    for attempt in range(3):
        args = (world, _free_port(), json.dumps(asdict(model_cfg)), json.dumps(layouts), str(tmp_path))
        try:
            mp.spawn(worker, args=args, nprocs=world, join=True)
            break
        except mp.ProcessRaisedException as err:
            if "EADDRINUSE" not in str(err) or attempt == 2:
                raise
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]


def assert_parity(results: list[dict], reference: tuple[list[float], list[float], float]) -> None:
    """Training losses and the clipped gradient norm step by step, then evaluation (forward only through every
    stage), as one process."""
    losses, norms, eval_loss = reference
    for name in results[0]:
        for rank, per_rank in enumerate(results):
            got = per_rank[name]["losses"]
            worst = max(abs(a - b) for a, b in zip(got, losses, strict=True))
            assert worst <= TOLERANCE, f"{name} rank {rank}: max |dloss| {worst:.2e} vs one process ({got} vs {losses})"
            got = per_rank[name]["norms"]
            assert got == pytest.approx(norms, rel=TOLERANCE), f"{name} rank {rank}: gradient norms {got} vs {norms}"
            evaluated = per_rank[name]["eval_loss"]
            assert evaluated == pytest.approx(eval_loss, abs=TOLERANCE), f"{name} rank {rank}: evaluation loss"


TP_SHARDED = ("attn.wq.", "attn.wk.", "attn.wv.", "mlp.w1.", "mlp.w3.")
TP_SHARDED_WEIGHT_ONLY = ("attn.wo.weight", "mlp.w2.weight", "tok_emb.weight", "lm_head.weight")


def expected_local_numel(model_cfg: ModelConfig, stages: list[int], num_stages: int, tp: int, dp_shard: int) -> int:
    """Elements a rank must hold: its stages' parameters, split over tp where the plan shards them, over dp_shard."""
    from disttrain.models.pipeline import stage_layers

    full = build_model(model_cfg, seed=0, device="meta")
    total = 0
    for stage in stages:
        layers = {f"blocks.{i}." for i in stage_layers(model_cfg.n_layers, num_stages, stage)}
        first, last = stage == 0, stage == num_stages - 1
        for name, param in full.named_parameters(remove_duplicate=False):
            held = any(name.startswith(prefix) for prefix in layers)
            held |= first and name.startswith(("tok_emb.", "pos_emb."))
            held |= last and name.startswith(("norm.", "lm_head."))
            if name == "lm_head.weight" and model_cfg.tie_embeddings and first and last:
                held = False  # the same Parameter as tok_emb.weight
            if not held:
                continue
            n = param.numel()
            if tp > 1 and (any(f".{p}" in f".{name}" for p in TP_SHARDED) or name.endswith(TP_SHARDED_WEIGHT_ONLY)):
                n //= tp
            total += n // dp_shard
    return total


def assert_shards(results: list[dict], model_cfg: ModelConfig, layouts: dict[str, dict], world: int) -> None:
    for name, options in layouts.items():
        tp, pp = options.get("tp", 1), options.get("pp", 1)
        num_stages = pp * options.get("virtual_stages", 1)
        for rank, per_rank in enumerate(results):
            got = per_rank[name]
            dp = world // (tp * pp)
            dp_shard = {"fsdp": dp, "replicate": 1, "hsdp": dp // options.get("dp_replicate", 1)}[
                options.get("dp_type", "fsdp")
            ]
            want = expected_local_numel(model_cfg, got["stages"], num_stages, tp, dp_shard)
            assert got["local_numel"] == want, (
                f"{name} rank {rank} holds {got['local_numel']} elements, expected {want}"
            )


TWO_RANK_GPT = {
    "tp2": {"tp": 2},
    "tp2_sequence_parallel": {"tp": 2, "sequence_parallel": True},
    "pp2_gpipe": {"pp": 2, "schedule": "gpipe", "microbatches": 4},
    "pp2_1f1b": {"pp": 2, "schedule": "1f1b", "microbatches": 4},
    "pp2_interleaved_1f1b": {"pp": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2, "microbatches": 4},
    "pp2_zero_bubble": {"pp": 2, "schedule": "zero_bubble", "virtual_stages": 2, "microbatches": 4},
    "pp2_1f1b_two_rounds": {"pp": 2, "microbatches": 2, "rounds": 2},
}
TWO_RANK_LLAMA = {
    "tp2_sp_selective": {"tp": 2, "sequence_parallel": True, "activation_checkpointing": "selective"},
    "tp2_gathered_logits": {"tp": 2, "loss_parallel": False},
    "pp2_full_recompute": {"pp": 2, "activation_checkpointing": "full"},
}
FOUR_RANK = {
    "dp2_tp2": {"tp": 2},
    "dp2_tp2_sequence_parallel": {"tp": 2, "sequence_parallel": True},
    "pp2_tp2": {"pp": 2, "tp": 2},
    "pp2_dp2": {"pp": 2},
    "pp2_dp2_replicated": {"pp": 2, "dp_type": "replicate"},
    "hsdp_2x2": {"dp_type": "hsdp", "dp_replicate": 2},
}


@pytest.mark.slow
def test_two_rank_layouts_match_one_process(tmp_path):
    """tp=2, sequence parallel, pp=2 with every schedule, recomputation: same losses as one process."""
    (tmp_path / "gpt").mkdir()
    gpt = run_layouts(tmp_path / "gpt", 2, GPT, TWO_RANK_GPT)
    assert_parity(gpt, reference_losses(GPT))
    assert_shards(gpt, GPT, TWO_RANK_GPT, 2)
    (tmp_path / "llama").mkdir()
    llama = run_layouts(tmp_path / "llama", 2, LLAMA, TWO_RANK_LLAMA)
    assert_parity(llama, reference_losses(LLAMA))
    assert_shards(llama, LLAMA, TWO_RANK_LLAMA, 2)


@pytest.mark.slow
def test_four_rank_layouts_match_one_process(tmp_path):
    """dp=2 x tp=2 (with and without SP), pp=2 x tp=2, pp=2 x dp=2 (sharded and replicated), HSDP."""
    results = run_layouts(tmp_path, 4, LLAMA, FOUR_RANK)
    assert_parity(results, reference_losses(LLAMA))
    assert_shards(results, LLAMA, FOUR_RANK, 4)
