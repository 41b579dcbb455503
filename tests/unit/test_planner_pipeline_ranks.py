"""Which pipeline rank holds what: the planner's placement equals the engine's (looped, V-shaped), and memory,
parameters and the tied-embedding all-reduce follow it."""

from __future__ import annotations

import dataclasses

import pytest

from disttrain.models.pipeline import stages_of_rank as engine_stages_of_rank
from disttrain.planner import Layout, Workload, activation_bytes, comm_plan, memory_per_gpu, model_shape
from disttrain.planner.bubble import stages_of_rank
from disttrain.planner.memory import output_activation_bytes, rank_parameters
from tests.conftest import hw_profile as hw
from tests.conftest import model_preset

GIB = 2**30
GPT2 = model_shape(model_preset("gpt2-124m"))  # tied embeddings, vocab 50257, 1024 tokens
GPT2_16 = model_shape(dataclasses.replace(model_preset("gpt2-124m"), n_layers=16))  # 16 layers split into 8 stages


@pytest.mark.parametrize(("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)])
@pytest.mark.parametrize("pp", [2, 4, 8])
def test_stage_placement_equals_the_engines(schedule: str, v: int, pp: int) -> None:
    for rank in range(pp):
        assert stages_of_rank(rank, pp, v, schedule) == engine_stages_of_rank(rank, pp, v, schedule)


def zbv(pp: int = 4) -> Layout:
    return Layout("megatron", dp=2, pp=pp, microbatches=4, schedule="zero_bubble", virtual_stages=2)


def test_v_schedule_puts_embeddings_head_and_both_tied_copies_on_rank_0() -> None:
    tied = GPT2_16.embedding[0].numel
    layer = GPT2_16.block_parameters
    per_rank = GPT2_16.n_layers // 4 * layer  # two chunks of L/8 layers
    assert rank_parameters(GPT2_16, zbv(), 3) == per_rank
    head = sum(t.numel for t in GPT2_16.head)
    assert rank_parameters(GPT2_16, zbv(), 0) == per_rank + sum(t.numel for t in GPT2_16.embedding) + head + tied
    # Every parameter (the tied copy twice) is on exactly one rank.
    assert sum(rank_parameters(GPT2_16, zbv(), r) for r in range(4)) == GPT2_16.num_parameters + tied


def test_gpt2_124m_tp1_pp4_dp2_zero_bubble_is_about_15_gib_with_the_logits_on_rank_0() -> None:
    workload = Workload(16, 128, 1024, "bf16-mixed")
    logits = output_activation_bytes(GPT2, 16, 1024, 2, 2, 1, False)
    rank0 = activation_bytes(GPT2, zbv(), workload, stage=0, flash=True)
    last = activation_bytes(GPT2, zbv(), workload, stage=3, flash=True)
    assert rank0 - last == pytest.approx(logits)  # one micro-batch of logits, at the V's turning point
    # 12 B per logit (the loss's backward peak): 16 x 1024 x 50257 x 12 B = 9.25 GiB of the rank's ~15 GiB.
    assert logits / GIB == pytest.approx(16 * 1024 * 50257 * 12 / GIB + 16 * 1024 * 768 * 4 / GIB)
    total = memory_per_gpu(GPT2, zbv(), workload, flash_attention=True).total / GIB
    assert 14 < total < 16, total


def test_tied_embedding_is_all_reduced_across_ranks_but_summed_locally_under_the_v_schedule() -> None:
    workload = Workload(1, 8, 1024, "bf16-mixed")
    one_f_one_b = Layout("megatron", dp=2, pp=4, microbatches=4, schedule="1f1b")
    assert comm_plan(GPT2, one_f_one_b, workload, hw("8xa100")).step_exposed.network > 0
    assert comm_plan(GPT2, zbv(), workload, hw("8xa100")).step_exposed.network == 0
