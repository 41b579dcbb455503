"""strategy=megatron's mesh and sharding plan at llama-70b scale (64-1024 ranks) on a fake process group.

The real engine (TP plan, FSDP2 on the data-parallel axes, pipeline stages and schedule) is built on the meta
device for one rank at a time: no weights, no communication. Each parameter's local shard must be its tensor-
parallel slice split over the data-parallel ranks as torch.chunk splits dim 0, and each stage's tensor-parallel
share must equal the planner's ``stage_parameters``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from disttrain.config.degrees import megatron_degrees
from disttrain.config.strategy_schema import MegatronConfig
from disttrain.planner import model_shape
from disttrain.strategies.megatron.engine import EngineSettings, MegatronEngine, build_mesh
from tests.conftest import model_preset
from tests.fake.test_planner_shards import fake_world

LLAMA_70B = model_preset("llama-70b")

LAYOUTS = [
    (64, MegatronConfig(tp=8, pp=8, schedule="1f1b", microbatches=8)),
    (
        512,
        MegatronConfig(
            tp=8, pp=4, schedule="interleaved_1f1b", virtual_stages=2, microbatches=8, sequence_parallel=True
        ),
    ),
    (1024, MegatronConfig(tp=8, pp=16, microbatches=16, dp_type="hsdp", dp_replicate=2)),
]


def tp_local_shape(param: DTensor, tp_dim_of_mesh: int) -> list[int]:
    shape = list(param.shape)
    placement = param.placements[tp_dim_of_mesh]
    if isinstance(placement, Shard):
        shape[placement.dim] //= param.device_mesh.size(tp_dim_of_mesh)
    return shape


def chunk_size(n: int, parts: int, index: int) -> int:
    size = math.ceil(n / parts)
    return max(0, min(size, n - index * size))


@pytest.mark.parametrize(("world", "strategy"), LAYOUTS, ids=[f"world{w}" for w, _ in LAYOUTS])
def test_llama70b_layouts_shard_as_planned(world: int, strategy: MegatronConfig) -> None:
    degrees = megatron_degrees(strategy, world)
    shape = model_shape(LLAMA_70B)
    num_stages = degrees.pp * strategy.virtual_stages
    # First and last pipeline rank, first and last data-parallel rank, tp rank 1.
    probes = [(pp, dp) for pp in (0, degrees.pp - 1) for dp in (0, degrees.dp_shard - 1)]
    for pp_rank, shard_rank in probes:
        rank = ((pp_rank * degrees.dp_replicate) * degrees.dp_shard + shard_rank) * degrees.tp + 1
        with fake_world(world, rank):
            mesh = build_mesh(degrees, "cpu")
            settings = EngineSettings(LLAMA_70B, strategy, degrees, torch.bfloat16, seed=0)
            engine = MegatronEngine(settings, mesh, torch.device("meta"))
            assert engine.schedule is not None
            for chunk, stage in zip(engine.chunks, engine.stage_ids, strict=True):
                tp_share = local_share = 0
                for name, param in chunk.named_parameters():
                    assert isinstance(param, DTensor), name
                    names = param.device_mesh.mesh_dim_names
                    tp_shape = tp_local_shape(param, names.index("tp")) if "tp" in names else list(param.shape)
                    tp_share += math.prod(tp_shape)
                    local = list(param.to_local().shape)
                    local_share += math.prod(local)
                    expected = [chunk_size(tp_shape[0], degrees.dp_shard, shard_rank), *tp_shape[1:]]
                    assert local == expected, f"rank {rank} {name}: {local} != {expected}"
                assert tp_share == shape.stage_parameters(degrees.tp, num_stages, stage), f"stage {stage}"
                if shard_rank == 0:  # chunk 0 of every tensor: the padded shard the planner counts
                    assert local_share == shape.stage_parameters(degrees.tp, num_stages, stage, degrees.dp_shard)
                assert len(chunk.block_list()) == LLAMA_70B.n_layers // num_stages


def test_replicated_data_parallel_keeps_whole_tp_shards() -> None:
    strategy = MegatronConfig(tp=8, pp=8, microbatches=8, dp_type="replicate")
    degrees = megatron_degrees(replace(strategy), 128)
    assert (degrees.dp_replicate, degrees.dp_shard) == (2, 1)
    with fake_world(128, rank=8):
        engine = MegatronEngine(
            EngineSettings(LLAMA_70B, strategy, degrees, None, seed=0), build_mesh(degrees, "cpu"), torch.device("meta")
        )
        wq = engine.chunks[0].blocks["0"].attn.wq.weight
        assert list(wq.to_local().shape) == [8192 // 8, 8192]
