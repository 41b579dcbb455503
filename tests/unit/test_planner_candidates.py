"""Planner candidates: which layouts are enumerated, how they are ranked, and what the recommendation selects."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest

from disttrain.config.schema import ModelConfig
from disttrain.planner import JSON_KEYS, Layout, Workload, candidate_layouts, count_shape, model_shape, plan
from disttrain.planner.plan import suggest_micro_batch
from tests.conftest import hw_profile as hw
from tests.conftest import model_preset as model

# The 1T GPT of Narayanan et al. 2021 (Table 1): 128 layers, hidden 25600, 160 heads, seq 2048, vocab 51200,
# global batch 3072; here on 128 nodes x 8 A100s.
ONE_T = ModelConfig(
    name="gpt-1t",
    n_layers=128,
    d_model=25600,
    n_heads=160,
    ffn_hidden=4 * 25600,
    vocab_size=51200,
    seq_len=2048,
    pos_emb="learned",
)
CLUSTER_1024 = dataclasses.replace(hw("8xa100"), name="128x8xa100", num_nodes=128)


def test_1t_model_over_1024_gpus() -> None:
    result = plan(ONE_T, CLUSTER_1024, micro_batch_size=1, global_batch_size=3072)
    # DDP 1; FSDP2 full shard and hybrid, each reshard x recompute x offload = 8; ZeRO-1 and -2 with
    # optimizer offload or not x recompute = 4 each, ZeRO-3 3 offload variants x recompute = 6.
    # Megatron: tp in {1, 2, 4, 8} (divides 8 GPUs/node and 160 heads); pp in {1, 2, ..., 128} (divides 128
    # layers and 1024/tp); dp = 1024/(tp pp) always divides 3072. Schedules: pp = 1 -> 1; pp = 2..32 ->
    # gpipe, 1f1b, interleaved v2 and v4, zero-bubble = 5; pp = 64 -> no v4 (128 % 256) = 4; pp = 128 -> 2.
    # Per tp 1 + 5 x 5 + 4 + 2 = 32 schedules x 3 recomputation modes = 96, x 4 tp = 384.
    assert len(result.candidates) == 415
    counts = Counter(c.strategy for c in result.candidates)
    assert counts == {"ddp": 1, "fsdp": 16, "deepspeed": 14, "megatron": 384}
    for c in result.candidates:
        layout = c.layout
        assert layout.world_size == 1024
        assert layout.microbatches * 1 * layout.dp == 3072  # micro-batch 1
        assert c.step_time_s > 0 and 0 < c.mfu < 1
    best = result.recommended
    assert best is not None and best.strategy == "megatron"
    # Narayanan et al. 2021 train the 1T model with 8-way tensor parallelism inside each DGX node, pipelining
    # across nodes; the planner lands on the same structure.
    assert best.layout.tp == 8 and best.layout.pp > 1


def test_tensor_parallel_divides_node_heads_and_kv_heads_and_pipeline_divides_layers() -> None:
    gqa = dataclasses.replace(model("llama-1b"), name="gqa", n_kv_heads=2)
    workload = Workload(1, 64, 2048, "bf16-mixed")
    for cfg, allowed in ((model("llama-1b"), {1, 2, 4, 8}), (gqa, {1, 2})):
        layouts = [x for x in candidate_layouts(model_shape(cfg), hw("8xa100"), workload) if x.strategy == "megatron"]
        assert {x.tp for x in layouts} == allowed
        assert all(cfg.n_layers % x.pp == 0 and x.world_size == 8 for x in layouts)
        assert all(x.sequence_parallel == (x.tp > 1) for x in layouts)
        interleaved = [x for x in layouts if x.schedule == "interleaved_1f1b"]
        assert interleaved and all(x.microbatches % x.pp == 0 for x in interleaved)


def test_hybrid_sharding_only_across_nodes_and_offload_only_on_gpus() -> None:
    shape, workload = model_shape(model("llama-7b")), Workload(1, 16, 4096, "bf16-mixed")
    one_node = candidate_layouts(shape, hw("8xh100"), Workload(1, 8, 4096, "bf16-mixed"))
    assert not [x for x in one_node if x.dp_replicate > 1]
    two_nodes = candidate_layouts(shape, hw("2x8xh100"), workload)
    assert {x.dp_replicate for x in two_nodes if x.strategy == "fsdp"} == {1, 2}
    cpu = dataclasses.replace(hw("cpu"), peak_tflops={"bf16": 1.0})
    on_cpu = candidate_layouts(shape, cpu, Workload(1, 2, 4096, "bf16-mixed"))
    assert on_cpu and not [x for x in on_cpu if x.offload_optimizer or x.offload_params]
    fp16 = candidate_layouts(shape, hw("8xh100"), Workload(1, 8, 4096, "fp16-mixed"))
    assert not [x for x in fp16 if x.strategy == "fsdp"]  # FSDP2 here supports fp32 and bf16 policies only


def test_global_batch_is_held_fixed() -> None:
    result = plan(model("llama-1b"), hw("8xa100"), micro_batch_size=2, global_batch_size=64)
    for c in result.candidates:
        assert c.layout.microbatches * 2 * c.layout.dp == 64
        if c.layout.microbatches > 1:
            assert c.overrides[-1] == "trainer.global_batch_size=64"


def test_ranking_fits_first_by_step_time_then_by_memory() -> None:
    result = plan(model("llama-13b"), hw("8xa100"), micro_batch_size=1)
    fits = [c for c in result.candidates if c.fits]
    rest = [c for c in result.candidates if not c.fits]
    assert fits and rest and result.candidates == (*fits, *rest)
    assert [c.step_time_s for c in fits] == sorted(c.step_time_s for c in fits)
    assert [c.memory.total for c in rest] == sorted(c.memory.total for c in rest)
    assert result.recommended is fits[0]
    assert all(c.memory.total <= result.memory_limit_bytes for c in fits)
    assert result.memory_limit_bytes == pytest.approx(0.9 * 80 * 2**30)


def test_overrides_select_the_layout() -> None:
    megatron = Layout(
        "megatron", dp=4, tp=8, pp=2, microbatches=16, sequence_parallel=True, schedule="1f1b", recompute="selective"
    )
    assert megatron.overrides() == [
        "strategy=megatron",
        "strategy.tp=8",
        "strategy.pp=2",
        "strategy.dp=auto",
        "strategy.sequence_parallel=true",
        "strategy.activation_checkpointing=selective",
        "strategy.schedule=1f1b",
        "strategy.microbatches=16",
    ]
    zero = Layout("deepspeed", dp=8, zero_stage=3, offload_optimizer=True)
    assert zero.overrides() == [
        "strategy=deepspeed",
        "strategy.stage=3",
        "strategy.offload_optimizer=true",
        "strategy.offload_params=false",
        "strategy.activation_checkpointing=false",
    ]
    fsdp = Layout("fsdp", dp=16, dp_replicate=2, recompute="full")
    assert fsdp.overrides() == [
        "strategy=fsdp",
        "strategy.reshard_after_forward=true",
        "strategy.activation_checkpointing=true",
        "strategy.cpu_offload=false",
        "strategy.dp_replicate=2",
    ]
    assert Layout("ddp", dp=8).overrides() == ["strategy=ddp"]


def test_json_entries_have_exactly_the_issue_keys() -> None:
    payload = json.loads(json.dumps(plan(model("llama-7b"), hw("2x8xh100"), micro_batch_size=1).to_json()))
    assert payload["recommended"]["overrides"][0].startswith("strategy=")
    for entry in payload["candidates"]:
        assert tuple(entry) == JSON_KEYS
        memory_keys = {"params", "grads", "optimizer_states", "activations", "buffers", "total", "host"}
        assert set(entry["memory_bytes"]) == memory_keys
        assert set(entry["comm_bytes_per_step"]) == {"intra_node", "inter_node", "total"}
    assert payload["candidates"][0]["strategy"] == payload["recommended"]["strategy"]


def test_raw_parameter_count_plans_model_states_only() -> None:
    result = plan(70_000_000_000, hw("2x8xh100"), seq_len=4096)
    assert not result.shape.known
    assert {c.strategy for c in result.candidates} == {"ddp", "fsdp", "deepspeed"}  # no layers to split
    assert all(c.memory.activations == 0 and c.layout.recompute == "none" for c in result.candidates)
    assert all("raw parameter count" in c.notes[0] for c in result.candidates)
    z3 = next(c for c in result.candidates if c.label == "ZeRO-3")
    assert z3.memory.params + z3.memory.grads + z3.memory.optimizer_states == 16 * 70_000_000_000 // 16


def test_when_nothing_fits_a_smaller_micro_batch_is_suggested() -> None:
    result = plan(model("llama-70b"), hw("2x8xh100"), micro_batch_size=16)
    assert result.recommended is None and "none of the" in result.reason()
    micro = suggest_micro_batch(result)
    assert micro is not None and micro < 16
    smaller = plan(
        model("llama-70b"), hw("2x8xh100"), micro_batch_size=micro, global_batch_size=result.workload.global_batch_size
    )
    assert smaller.recommended is not None


def test_profile_without_memory_is_not_fit_checked() -> None:
    unknown = dataclasses.replace(hw("8xa100"), memory_per_device_gib=None)
    result = plan(count_shape(10**9, 1024), unknown)
    assert result.memory_limit_bytes is None and all(c.fits for c in result.candidates)
    assert "no per-device memory" in result.candidates[0].notes[-1]
