"""Planner terms of expert parallelism, checked by hand against the shape of Mixtral-8x7B on 8 and 16 H100s, and
the expert-parallel layouts in the step composition, ``python -m plan`` and ``strategy=auto``."""

from __future__ import annotations

import dataclasses

import pytest

from disttrain.config.parse import parse_run_config
from disttrain.planner.comm import comm_plan
from disttrain.planner.expert_shapes import dense_shape
from disttrain.planner.experts import active_flops_per_token, expert_layouts
from disttrain.planner.links import Sync
from disttrain.planner.memory import memory_per_gpu
from disttrain.planner.plan import plan, plan_layout
from disttrain.planner.shapes import model_shape
from disttrain.planner.spec import Layout, Workload
from disttrain.strategies.auto import expert_parallel_candidates, layout_of, megatron_candidates, resolve_auto
from disttrain.strategies.layout import batch_plan, parallel_layout, validate_run, world_layout
from tests.conftest import compose_train, hw_profile, model_preset

MIXTRAL = model_shape(model_preset("mixtral-8x7b"))
EXPERT = 3 * 4096 * 14336  # w1, w3 [4096, 14336] and w2 [14336, 4096]: 176,160,768 parameters
WORKLOAD = Workload(micro_batch_size=1, global_batch_size=8, seq_len=4096, precision="bf16-mixed")


def test_each_ep_that_divides_experts_and_world_with_the_experts_a_rank_holds() -> None:
    layouts = {layout.ep: layout for layout in expert_layouts(MIXTRAL, hw_profile("8xh100"), WORKLOAD)}
    assert sorted(layouts) == [1, 2, 4, 8]
    # ep=8: one whole expert per rank and layer (no expert-data-parallel peers to shard it with).
    assert layouts[8].expert_parameters == 32 * EXPERT
    # ep=1: 8 experts FSDP-sharded on dim 0 over 8 ranks: again one expert per rank and layer.
    assert layouts[1].expert_parameters == 32 * EXPERT
    # ep=2: 4 experts per rank group, sharded over 4 peers: one each.
    assert layouts[2].expert_parameters == 32 * EXPERT
    dense = MIXTRAL.num_parameters - 32 * 8 * EXPERT
    assert layouts[8].dense_parameters == pytest.approx(dense / 8, rel=1e-6)  # padding only
    assert layouts[8].state_bytes == 16 * layouts[8].parameters


def test_all_to_all_volume_and_time_by_hand() -> None:
    hw = hw_profile("8xh100")
    layouts = {layout.ep: layout for layout in expert_layouts(MIXTRAL, hw, WORKLOAD)}
    # 4096 tokens x top-2 x 4096 values x 2 bytes, 4 exchanges per layer, 32 layers, 7 of 8 destinations remote.
    sent = 4 * 32 * 4096 * 2 * 4096 * 2 * 7 / 8
    assert layouts[8].all_to_all.intra == pytest.approx(sent) and layouts[8].all_to_all.inter == 0
    assert layouts[8].all_to_all_s == pytest.approx(sent / 450e9, rel=1e-9)  # NVLink 450 GB/s, no latency given
    assert layouts[1].all_to_all.network == 0 and layouts[1].all_to_all_s == 0
    assert layouts[2].all_to_all.intra == pytest.approx(sent * (1 / 2) / (7 / 8))


def test_ep_across_nodes_sends_the_remote_share_over_the_network() -> None:
    hw = hw_profile("2x8xh100")
    [layout] = [x for x in expert_layouts(MIXTRAL, hw, WORKLOAD) if x.ep == 8]
    assert layout.all_to_all.inter == 0  # 8 consecutive ranks: one node
    experts16 = model_shape(model_preset("olmoe-1b-7b"))
    [wide] = [x for x in expert_layouts(experts16, hw, WORKLOAD) if x.ep == 16]
    sent = 4 * 16 * 4096 * 8 * 2048 * 2
    assert wide.all_to_all.intra == pytest.approx(sent * 7 / 16)
    assert wide.all_to_all.inter == pytest.approx(sent * 8 / 16)


def test_flops_count_active_parameters() -> None:
    active = 12_879_925_248 - 32000 * 4096  # Mixtral's active count minus the token-embedding lookup
    attention = 12 * 32 * 32 * 128 * 4096
    assert active_flops_per_token(MIXTRAL, 4096) == pytest.approx(6 * active + attention, rel=1e-12)


# -- expert-parallel layouts in the step composition, `python -m plan` and strategy=auto ------------------------------

EP8 = Layout("fsdp", dp=8, ep=8)
ONE_NODE = hw_profile("8xh100")


def _sent(ep: int) -> float:
    """All-to-all bytes one rank sends per micro-batch, by hand: 4096 tokens x top-2 x 4096 values x 2 bytes,
    dispatch and combine in forward and again (reversed) in backward, 32 layers, (ep - 1) / ep of it remote."""
    return 4 * 32 * 4096 * 2 * 4096 * 2 * (ep - 1) / ep


def test_expert_parallel_traffic_is_the_dense_models_fsdp_plus_expert_units_plus_all_to_alls() -> None:
    dense = comm_plan(dense_shape(MIXTRAL), Layout("fsdp", dp=8), WORKLOAD, ONE_NODE)
    for ep in (2, 8):
        plan = comm_plan(MIXTRAL, Layout("fsdp", dp=8, ep=ep), WORKLOAD, ONE_NODE)
        # The all-to-alls are on the critical path (the experts wait for their tokens).
        assert plan.mb_exposed.network == pytest.approx(_sent(ep))
        [op] = plan.mb_exposed.ops
        assert op.op == "all_to_all" and op.intra_calls == 5 * 32  # counts, dispatch, combine; 2 reversed
        # ep=2: each rank's 4 experts per layer are a unit sharded over the 4 ranks holding them: all-gathered in
        # forward (3/4 of the bf16 buffer moves), again in backward, and fp32 gradients reduce-scattered.
        # ep=8: one expert per rank, nobody to shard with: nothing moves for the experts.
        experts = 32 * (8 // ep) * EXPERT
        share = (8 // ep - 1) / (8 // ep)
        assert plan.mb_fwd.network - dense.mb_fwd.network == pytest.approx(share * 2 * experts)
        assert plan.mb_bwd.network - dense.mb_bwd.network == pytest.approx(share * (2 + 4) * experts)
        assert Sync(ep, 5 * 32) in plan.mb_syncs


def test_all_to_all_time_is_in_the_predicted_step() -> None:
    predicted = plan_layout(MIXTRAL, EP8, WORKLOAD, ONE_NODE)
    without = plan_layout(MIXTRAL, Layout("fsdp", dp=8), WORKLOAD, ONE_NODE)
    # NVLink 450 GB/s, no latency in the profile; under ep=8 the only other traffic is the dense parts' (1.6B
    # parameters), which hides behind compute: what is exposed is exactly the all-to-alls' time.
    assert predicted.estimate.exposed_comm_s == pytest.approx(_sent(8) / 450e9, rel=1e-9)
    # Full sharding all-gathers every expert (46.7B parameters) instead, more than compute can hide.
    assert without.estimate.exposed_comm_s > predicted.estimate.exposed_comm_s
    assert predicted.estimate.compute_s == without.estimate.compute_s  # active FLOPs do not depend on ep
    assert predicted.comm.network == pytest.approx(comm_plan(MIXTRAL, EP8, WORKLOAD, ONE_NODE).per_step(1).network)


def test_expert_parallel_memory_holds_this_ranks_shard_of_its_experts_and_of_the_dense_parts() -> None:
    memory = memory_per_gpu(MIXTRAL, EP8, WORKLOAD, flash_attention=True)
    [layout] = [x for x in expert_layouts(MIXTRAL, ONE_NODE, WORKLOAD) if x.ep == 8]
    assert memory.params == 4 * layout.parameters  # fp32 master weights under bf16-mixed
    assert memory.optimizer_states == 2 * 4 * layout.parameters
    # Gathered per block: the dense block and this rank's one expert, not all eight: 7 experts fewer in each of
    # the two gathered blocks (current and prefetched, bf16) and in one block's gradient (bf16) and its fp32
    # reduce-scatter input.
    full = memory_per_gpu(MIXTRAL, Layout("fsdp", dp=8), WORKLOAD, flash_attention=True)
    assert full.buffers - memory.buffers == pytest.approx((2 * 2 + 2 + 4) * 7 * EXPERT)


def test_plan_lists_ep_layouts_that_strategy_ep_accepts_with_overrides_that_run() -> None:
    result = plan(MIXTRAL, ONE_NODE, micro_batch_size=1)
    labels = [c.label for c in result.candidates]
    assert {ep for ep in (2, 4, 8) if any(f"EP{ep}" in label for label in labels)} == {2, 4, 8}
    # strategy=megatron: the tp ranks split the experts (tp dividing them), without sequence parallelism; each TP
    # layout's launch passes validation.
    megatron = [c for c in result.candidates if c.strategy == "megatron"]
    assert {c.layout.tp for c in megatron} == {1, 2, 4, 8}
    assert not any(c.layout.sequence_parallel for c in megatron)
    [tp8] = [c for c in megatron if c.layout.tp == 8 and c.layout.pp == 1 and c.layout.recompute == "none"]
    batch = ["trainer.micro_batch_size=1", "trainer.global_batch_size=8"]  # the plan's workload
    validate_run(parse_run_config(compose_train(["model=mixtral-8x7b", "hw=8xh100", *batch, *tp8.overrides])))
    # Each tp rank holds one of the eight experts of a block (and an eighth of attention): the expert-parallel
    # FSDP layout at ep=8 holds the same experts per rank.
    [ep8_fsdp] = [x for x in expert_layouts(MIXTRAL, ONE_NODE, WORKLOAD) if x.ep == 8]
    assert MIXTRAL.block_tp_numel(8) < ep8_fsdp.parameters / MIXTRAL.n_layers + EXPERT
    # transformers' MoE blocks have no TP plan: their shapes get no Megatron layouts.
    hf_like = plan(dataclasses.replace(MIXTRAL, megatron_experts=False), ONE_NODE, micro_batch_size=1)
    assert not any(c.strategy == "megatron" for c in hf_like.candidates)
    [ep8] = [c for c in result.candidates if c.label == "FSDP2 full shard EP8"]
    assert "strategy.ep=8" in ep8.overrides
    cfg = parse_run_config(compose_train(["model=mixtral-8x7b", "hw=8xh100", *ep8.overrides]))
    validate_run(cfg)  # what plan prints launches
    assert layout_of(cfg.strategy, world_layout(cfg), batch_plan(cfg)).ep == 8
    dense = plan(model_shape(model_preset("llama-7b")), ONE_NODE, micro_batch_size=1)
    assert not any(c.layout.ep > 1 for c in dense.candidates)


def test_auto_considers_each_ep_the_run_accepts() -> None:
    base = ["strategy=auto", "hw=8xh100", "trainer.micro_batch_size=1", "precision=bf16-mixed"]
    cfg = parse_run_config(compose_train([*base, "model=mixtral-8x7b"]))
    assert sorted({o.ep for o in expert_parallel_candidates(cfg)}) == [2, 4, 8]
    # validate_expert_parallel's rules: 6 experts split over 2 (of the world's 1, 2, 4, 8), not 4 or 8.
    six = parse_run_config(compose_train([*base, "model=mixtral-8x7b", "model.num_experts=6"]))
    assert sorted({o.ep for o in expert_parallel_candidates(six)}) == [2]
    assert expert_parallel_candidates(parse_run_config(compose_train([*base, "model=llama-7b"]))) == []
    _, why = resolve_auto(cfg, parallel_layout(cfg))
    _, dense_why = resolve_auto(six, parallel_layout(six))
    scored = [int(text.split(" of ")[1].split()[0]) for text in (why, dense_why)]
    # 2 more degrees x (2 reshard x 2 recompute + offload), and the Megatron layouts whose tp splits 8 experts
    # but not 6 (tp=4, 8).
    more_megatron = len(megatron_candidates(cfg, parallel_layout(cfg).batch)) - len(
        megatron_candidates(six, parallel_layout(six).batch)
    )
    assert more_megatron > 0
    assert scored[0] - scored[1] == 2 * 5 + more_megatron
