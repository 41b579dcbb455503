"""Planner terms of expert parallelism, checked by hand against the shape of Mixtral-8x7B on 8 and 16 H100s."""

from __future__ import annotations

import pytest

from disttrain.planner.experts import active_flops_per_token, expert_layouts
from disttrain.planner.shapes import model_shape
from disttrain.planner.spec import Workload
from tests.conftest import hw_profile, model_preset

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
