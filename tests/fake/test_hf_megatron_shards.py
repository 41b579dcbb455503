"""strategy=megatron for an HF Llama at llama-70b scale on a fake process group: the real engine (the model's own
tp plan, vocab-parallel embedding and head, sequence parallelism, FSDP2, stages by decoder layer) built on the meta
device for one rank. Each stage's tensor-parallel share must be the planner's ``stage_parameters`` (the planner
counts a vocab-parallel embedding and head), and under sequence parallelism the norms must hold replicated weights
and see ``1/tp`` of the sequence while attention and the MLP see all of it.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from disttrain.config.degrees import megatron_degrees
from disttrain.config.hf import hf_shape
from disttrain.config.schema import HFModelConfig
from disttrain.config.strategy_schema import MegatronConfig
from disttrain.planner import model_shape
from disttrain.strategies.megatron.engine import EngineSettings, MegatronEngine, build_mesh
from tests.fake.test_megatron_shards import tp_local_shape
from tests.fake.test_planner_shards import fake_world

# Llama-3-70B's shape as an inline transformers config.
LLAMA_70B = HFModelConfig(
    name="hf-llama-70b",
    config={
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    seq_len=4096,
)


SMALL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "vocab_size": 1024,
}
SEQ = 64


@pytest.mark.parametrize("pp_rank", [0, 7])
def test_hf_llama70b_tp8_pp8_sp_shards_as_planned(pp_rank: int) -> None:
    strategy = MegatronConfig(tp=8, pp=8, microbatches=8, sequence_parallel=True)
    degrees = megatron_degrees(strategy, 64)
    shape = model_shape(hf_shape(LLAMA_70B))
    rank = pp_rank * degrees.tp + 1  # tp rank 1 of this pipeline rank (dp = 1)
    with fake_world(64, rank):
        engine = MegatronEngine(
            EngineSettings(LLAMA_70B, strategy, degrees, torch.bfloat16, seed=0),
            build_mesh(degrees, "cpu"),
            torch.device("meta"),
        )
        (chunk,) = engine.chunks
        tp_share, vocab_parallel = 0, []
        for name, param in chunk.named_parameters():
            assert isinstance(param, DTensor), name
            names = param.device_mesh.mesh_dim_names
            tp_placement = param.placements[names.index("tp")] if "tp" in names else None
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                assert tp_placement == Shard(0), name  # vocab-parallel
                vocab_parallel.append(name)
            if name.endswith("norm.weight"):  # RMSNorms: replicated over tp (SequenceParallel)
                assert tp_placement == Replicate(), name
            tp_share += math.prod(tp_local_shape(param, names.index("tp")) if "tp" in names else param.shape)
        assert tp_share == shape.stage_parameters(degrees.tp, degrees.pp, pp_rank)
        assert vocab_parallel == ["hf.model.embed_tokens.weight" if pp_rank == 0 else "hf.lm_head.weight"]
        assert len(chunk.blocks) == 80 // 8


def test_hf_sequence_parallel_runs_norms_on_sequence_slices() -> None:
    # Small enough to run on the CPU (a fake process group moves no data: shapes only, values meaningless).
    small = HFModelConfig(name="hf-small", config={**LLAMA_70B.config, **SMALL}, seq_len=SEQ)
    strategy = MegatronConfig(tp=8, sequence_parallel=True)
    degrees = megatron_degrees(strategy, 8)
    with fake_world(8, rank=3):
        engine = MegatronEngine(
            EngineSettings(small, strategy, degrees, None, seed=0), build_mesh(degrees, "cpu"), torch.device("cpu")
        )
        (chunk,) = engine.chunks
        seen: dict[str, tuple[int, ...]] = {}

        def record(name: str):
            def hook(_: torch.nn.Module, args: tuple, kwargs: dict) -> None:
                x = args[0] if args else kwargs["hidden_states"]
                seen.setdefault(name, tuple(x.to_local().shape if isinstance(x, DTensor) else x.shape))

            return hook

        base = chunk.hf.model
        layer = base.layers[:1][0]
        for name, module in {
            "layer": layer,
            "input_layernorm": layer.input_layernorm,
            "q_proj": layer.self_attn.q_proj,
            "post_attention_layernorm": layer.post_attention_layernorm,
            "gate_proj": layer.mlp.gate_proj,
            "norm": base.norm,
            "lm_head": chunk.hf.lm_head,
        }.items():
            module.register_forward_pre_hook(record(name), with_kwargs=True)

        def embedded(_: torch.nn.Module, __: tuple, out: torch.Tensor) -> None:
            seen["embedding"] = tuple(out.shape)

        base.embed_tokens.register_forward_hook(embedded)
        with torch.no_grad():
            logits = chunk(torch.zeros((1, SEQ), dtype=torch.long))
    slice_, whole, hidden = SEQ // 8, SEQ, SMALL["hidden_size"]
    assert seen == {
        "embedding": (1, whole, hidden),  # replicated: the model's forward derives RoPE and the mask from all of it
        "layer": (1, slice_, hidden),  # the first layer takes its slice
        "input_layernorm": (1, slice_, hidden),
        "q_proj": (1, whole, hidden),
        "post_attention_layernorm": (1, slice_, hidden),
        "gate_proj": (1, whole, hidden),
        "norm": (1, slice_, hidden),
        "lm_head": (1, whole, hidden),
    }
    # loss_parallel: the logits stay sharded over the vocabulary.
    assert isinstance(logits, DTensor) and logits.placements[-1] == Shard(2)
    assert tuple(logits.to_local().shape) == (1, whole, SMALL["vocab_size"] // 8)
