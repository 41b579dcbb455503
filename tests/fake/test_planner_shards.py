"""The planner's per-rank parameter shard equals what FSDP2 and tensor parallelism actually allocate.

A fake process group (no processes, no communication) and models on the meta device: only shapes, never values.
FSDP2 is applied exactly as ``strategy=fsdp`` applies it (``disttrain.strategies.fsdp.apply_fsdp``); the TP plan is
the Megatron layout the planner models (column-parallel q/k/v and MLP inputs, row-parallel outputs,
vocab-parallel embedding and head).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from disttrain.config.schema import ModelConfig, PrecisionConfig
from disttrain.config.strategy_schema import FSDPConfig
from disttrain.models import build_model
from disttrain.planner import model_shape
from disttrain.strategies.fsdp import apply_fsdp
from tests.conftest import model_preset as preset


@contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp_allocated(model: torch.nn.Module) -> int:
    """Sharded parameter elements FSDP2 allocates on this rank (each parameter padded to chunk 0's size)."""
    total = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            total += sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params) if group else 0
    return total


# 8..64 ranks, including sizes that leave uneven last chunks (vocab 50257 and 256 over 12 or 24 ranks).
WORLD_SIZES = [8, 12, 24, 64]


@pytest.mark.parametrize("name", ["gpt-nano", "gpt2-124m", "llama-1b"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fsdp2_shard_matches_planner(name: str, world_size: int) -> None:
    cfg = preset(name)
    shape = model_shape(cfg)
    for rank in (0, world_size - 1):  # chunk 0 sets the padded size every rank allocates
        with fake_world(world_size, rank):
            mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",))
            model = build_model(cfg, seed=0, device="meta")
            apply_fsdp(model, mesh, FSDPConfig(), PrecisionConfig(name="bf16-mixed"), apply_checkpointing=None)
            assert fsdp_allocated(model) == shape.fsdp_shard_parameters(world_size)
            assert fsdp_allocated(model.blocks[0]) == shape.fsdp_block_shard_parameters(world_size)


@pytest.mark.parametrize(("world_size", "replicas"), [(8, 2), (16, 2), (64, 8)])
def test_hybrid_fsdp2_shards_within_each_replica_group(world_size: int, replicas: int) -> None:
    """strategy.dp_replicate (HSDP): each rank holds 1/(world/replicas) of the model, as the planner says."""
    cfg = preset("llama-1b")
    with fake_world(world_size, rank=world_size - 1):
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",))
        model = build_model(cfg, seed=0, device="meta")
        options = FSDPConfig(dp_replicate=replicas)
        apply_fsdp(model, mesh, options, PrecisionConfig(name="bf16-mixed"), apply_checkpointing=None)
        assert fsdp_allocated(model) == model_shape(cfg).fsdp_shard_parameters(world_size // replicas)


def tensor_parallel_plan(n_layers: int, swiglu: bool) -> dict[str, object]:
    plan: dict[str, object] = {"tok_emb": RowwiseParallel(), "lm_head": ColwiseParallel()}
    for i in range(n_layers):
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", *(("mlp.w3",) if swiglu else ())):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.wo"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.w2"] = RowwiseParallel()
    return plan


# Untied (a vocab-parallel embedding and a separately sharded head), one with biases and an odd vocabulary.
GPT_UNTIED = ModelConfig(
    name="gpt-untied", n_layers=2, d_model=256, n_heads=8, ffn_hidden=1024, vocab_size=1001, tie_embeddings=False
)
LLAMA_GQA = ModelConfig(
    name="llama-gqa",
    family="llama",
    n_layers=2,
    d_model=256,
    n_heads=8,
    n_kv_heads=4,
    ffn_hidden=688,
    vocab_size=1000,
    norm="rmsnorm",
    mlp="swiglu",
    pos_emb="rope",
    bias=False,
    tie_embeddings=False,
)


@pytest.mark.parametrize("cfg", [GPT_UNTIED, LLAMA_GQA], ids=lambda c: c.name)
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shard_matches_planner(cfg: ModelConfig, tp: int) -> None:
    with fake_world(tp, rank=0):
        mesh = init_device_mesh("cpu", (tp,))
        model = build_model(cfg, seed=0, device="meta")
        parallelize_module(model, mesh, tensor_parallel_plan(cfg.n_layers, cfg.mlp == "swiglu"))
        held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
        assert held == model_shape(cfg).stage_parameters(tp, pp=1, stage=0)


@pytest.mark.parametrize(("world_size", "ep"), [(8, 1), (8, 8), (16, 2), (64, 1), (64, 8)])
def test_expert_parallel_shards_match_planner(world_size: int, ep: int) -> None:
    """strategy.ep: experts FSDP2-sharded over world/ep ranks (on dim 1 where fewer experts than ranks), the rest
    over the world; with 8 experts on 64 ranks dim-0 chunks would give every rank a whole expert of padding."""
    from disttrain.planner.experts import dense_parameters_per_rank, expert_parameters_per_rank

    cfg = preset("mixtral-8x7b")
    shape = model_shape(cfg)
    with fake_world(world_size, rank=world_size - 1):
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("data_parallel",))
        model = build_model(cfg, seed=0, device="meta")
        apply_fsdp(model, mesh, FSDPConfig(ep=ep), PrecisionConfig(name="bf16-mixed"), apply_checkpointing=None)
        expected = expert_parameters_per_rank(shape, ep, world_size) + dense_parameters_per_rank(shape, world_size)
        assert fsdp_allocated(model) == expected
        # Every layout holds its even share of the whole model (to padding): experts are never duplicated.
        assert fsdp_allocated(model) == pytest.approx(shape.num_parameters / world_size, rel=0.01)
