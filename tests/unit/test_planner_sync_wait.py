"""Per-collective link figures and the wait of blocking collectives for their group's last rank (rank drift)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from diagnostics.calibration import expected_max_of_normals, sync_figures
from disttrain.config.errors import ConfigError
from disttrain.config.hardware import validate_profile
from disttrain.planner import Layout, Workload, collective_bytes, comm_plan, model_shape, plan_layout
from disttrain.planner.comm import tp_collectives_per_layer
from disttrain.planner.links import Group, Sync, link_time
from disttrain.planner.plan import DEFAULT_ASSUMPTIONS
from disttrain.planner.step_time import sync_wait_seconds
from disttrain.planner.terms.megatron import LOSS_PARALLEL_COLLECTIVES
from tests.conftest import hw_profile as hw
from tests.conftest import model_preset as model

# A CPU box as a calibration describes it: 2 GB/s and 0.5 ms per call on the link, gloo's all-gather far slower.
CPU = dataclasses.replace(
    hw("cpu"),
    peak_tflops={"fp32": 0.02},
    hbm_bandwidth_gbps=5.0,
    intra_node_bandwidth_gbps=2.0,
    intra_node_latency_us=500.0,
    collective_busbw_gbps={"intra_node.all_gather": 0.25},
    collective_latency_us={"intra_node.all_gather": 2000.0, "intra_node.all_reduce": 300.0},
)


def test_each_collective_uses_its_own_bus_bandwidth_and_latency_else_the_links() -> None:
    pair = Group(2, 2)
    traffic = collective_bytes("all_reduce", 1e6, pair) + collective_bytes("all_gather", 1e6, pair, calls=3)
    traffic += collective_bytes("reduce_scatter", 1e6, pair)
    # all-reduce: 1e6 bytes at the link's 2 GB/s + its own 0.3 ms; all-gather: 0.5e6 at 0.25 GB/s + 3 x 2 ms;
    # reduce-scatter has no figures of its own: 0.5e6 at 2 GB/s + the link's 0.5 ms
    expected = (0.5e-3 + 0.3e-3) + (2e-3 + 6e-3) + (0.25e-3 + 0.5e-3)
    assert link_time(traffic, CPU, 25.0) == pytest.approx(expected)
    assert link_time(traffic.scale(2), CPU, 25.0) == pytest.approx(2 * expected)
    assert [t.op for t in traffic.ops] == ["all_gather", "all_reduce", "reduce_scatter"]
    # without per-collective figures it is the link's alone, as before
    plain = dataclasses.replace(CPU, collective_busbw_gbps={}, collective_latency_us={})
    assert link_time(traffic, plain, 25.0) == pytest.approx(2e6 / 2e9 + 5 * 0.5e-3)


def test_per_collective_keys_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"hw.collective_busbw_gbps: unknown key 'nvlink.all_reduce'.*<link>.<op>"):
        validate_profile(dataclasses.replace(CPU, collective_busbw_gbps={"nvlink.all_reduce": 1.0}))
    with pytest.raises(ConfigError, match=r"hw.collective_latency_us: 'intra_node.p2p' must be > 0"):
        validate_profile(dataclasses.replace(CPU, collective_latency_us={"intra_node.p2p": 0.0}))
    with pytest.raises(ConfigError, match=r"hw.compute_jitter: must be >= 0"):
        validate_profile(dataclasses.replace(CPU, compute_jitter=-1.0))
    with pytest.raises(ConfigError, match=r"hw.host_memory_gib: must be >= 0"):
        validate_profile(dataclasses.replace(CPU, host_memory_gib=-1.0))


def test_expected_lag_of_the_last_rank_in_sigmas() -> None:
    assert expected_max_of_normals(1) == 0.0
    assert expected_max_of_normals(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-4)  # exact: 1/sqrt(pi)
    assert expected_max_of_normals(8) == pytest.approx(1.4236)
    assert expected_max_of_normals(16) == pytest.approx(1.7660, rel=3e-3)  # Harter's table
    assert expected_max_of_normals(100) == pytest.approx(2.5076, rel=5e-3)


def test_the_last_rank_to_arrive_measures_the_call_the_others_the_drift() -> None:
    # 2 ranks, 4 ms segments, a warm call of 0.5 ms: per round the shortest wait is the call after compute
    overhead, sigma = sync_figures(0.004, 0.0005, [[0.003, 0.001, 0.001], [0.001, 0.002, 0.001]])
    assert overhead == pytest.approx(0.0005)  # median of 1, 1, 1 ms, less the warm 0.5
    assert sigma == pytest.approx((0.002 + 0.001) / 6 / (0.004**0.5 * 0.5642))
    assert sync_figures(0.004, 0.002, [[0.001], [0.0015]])[0] == 0.0  # faster than warm: no overhead
    assert sync_figures(0.004, 0.0005, [[0.003, 0.001]]) is None  # one rank cannot tell its wait's parts apart


def test_many_small_syncs_wait_longer_than_one_per_step() -> None:
    # 1 s of compute cut by 4 syncs of 2 ranks: 4 x sigma x sqrt(0.25 s) x 0.5642
    assert sync_wait_seconds(1.0, [Sync(2, 4)], 0.01) == pytest.approx(4 * 0.01 * 0.5 * 0.5642)
    # mixed groups share the segments: 3 pair syncs and one of 8 ranks over 2 s, segments of 0.5 s
    mixed = sync_wait_seconds(2.0, [Sync(2, 3), Sync(8, 1)], 0.01)
    assert mixed == pytest.approx(0.01 * math.sqrt(0.5) * (3 * 0.5642 + 1.4236))
    assert sync_wait_seconds(1.0, [Sync(2, 4)], None) == 0.0  # a datasheet profile: not modelled
    assert sync_wait_seconds(1.0, [Sync(1, 4)], 0.01, 0.001) == 0.0  # one rank waits for no one
    # each call also pays the overhead of a call right after compute
    assert sync_wait_seconds(1.0, [Sync(2, 4)], 0.01, 0.001) == pytest.approx(4 * 0.001 + 4 * 0.01 * 0.5 * 0.5642)


def test_tensor_parallel_pays_a_wait_per_activation_collective_ddp_one_per_step() -> None:
    shape = model_shape(model("gpt-nano"))
    box = dataclasses.replace(CPU, compute_jitter=0.02, sync_overhead_us=400.0)
    work = Workload(16, 32, shape.seq_len, "fp32")
    tp_layout = Layout("megatron", tp=2, microbatches=2)
    # + the embedding's and the head's, and the vocab-parallel loss's three reductions
    per_mb = tp_collectives_per_layer(shape.swiglu) * shape.n_layers + 2 + LOSS_PARALLEL_COLLECTIVES
    traffic = comm_plan(shape, tp_layout, work, box)
    assert traffic.mb_syncs == (Sync(2, per_mb),) and traffic.step_syncs == (Sync(2, 1),)
    tp = plan_layout(shape, tp_layout, work, box, DEFAULT_ASSUMPTIONS).estimate
    calls = 2 * per_mb + 1
    drift = 0.02 * math.sqrt(tp.compute_s / calls) * calls * 0.5642
    assert tp.sync_wait_s == pytest.approx(calls * 400e-6 + drift)
    ddp = plan_layout(shape, Layout("ddp", dp=2), work, box, DEFAULT_ASSUMPTIONS).estimate
    assert ddp.sync_wait_s == pytest.approx(400e-6 + 0.02 * math.sqrt(ddp.compute_s) * 0.5642)
    assert tp.sync_wait_s > 5 * ddp.sync_wait_s
    without = plan_layout(shape, tp_layout, work, CPU, DEFAULT_ASSUMPTIONS).estimate
    assert tp.step_time_s - without.step_time_s == pytest.approx(tp.sync_wait_s)


def test_fsdp_and_zero_wait_every_micro_batch_pipelines_at_each_send() -> None:
    shape = model_shape(model("gpt-nano"))
    work = Workload(4, 16, shape.seq_len, "fp32")
    fsdp = comm_plan(shape, Layout("fsdp", dp=2, microbatches=2), work, CPU)
    # the last reduce-scatter, then the per-unit collectives (4 blocks + the root gathered, 4 blocks regathered,
    # 5 reduce-scatters), waiting only as far as compute does not hide them
    assert fsdp.mb_syncs == (Sync(2, 1), Sync(2, 13, hideable=True))
    assert comm_plan(shape, Layout("deepspeed", dp=2, zero_stage=1, microbatches=2), work, CPU).mb_syncs == ()
    assert comm_plan(shape, Layout("deepspeed", dp=2, zero_stage=2, microbatches=2), work, CPU).mb_syncs == (
        Sync(2, 1),
    )
    pipeline = Layout("megatron", pp=2, microbatches=4, schedule="1f1b")
    assert comm_plan(shape, pipeline, Workload(4, 16, shape.seq_len, "fp32"), CPU).mb_syncs == (Sync(2, 2),)


def test_fsdp_collectives_wait_for_the_last_rank_as_far_as_compute_does_not_hide_them() -> None:
    shape = model_shape(model("gpt-nano"))
    work = Workload(4, 16, shape.seq_len, "fp32")
    layout = Layout("fsdp", dp=2, microbatches=2)
    drifting = dataclasses.replace(CPU, compute_jitter=0.01, sync_overhead_us=100.0)
    fsdp = comm_plan(shape, layout, work, drifting)
    compute = plan_layout(shape, layout, work, drifting).estimate.compute_s
    for hidden in (0.0, 0.5, 1.0):
        estimate = plan_layout(shape, layout, work, dataclasses.replace(drifting, comm_overlap=hidden)).estimate
        syncs = [Sync(2, 2 * (1 if not s.hideable else 13 * (1 - hidden))) for s in fsdp.mb_syncs]
        expected = sync_wait_seconds(compute, [*syncs, *fsdp.step_syncs], 0.01, 100e-6)
        assert estimate.sync_wait_s == pytest.approx(expected)
    # none hidden (gloo on a CPU): every per-unit collective waits; all hidden: only the last reduce-scatter
    hides = [dataclasses.replace(drifting, comm_overlap=h) for h in (0.0, 1.0)]
    waits = [plan_layout(shape, layout, work, box).estimate for box in hides]
    assert waits[0].sync_wait_s > waits[1].sync_wait_s > 0


def test_a_gpu_datasheet_profile_models_no_drift() -> None:
    shape = model_shape(model("llama-7b"))
    box = hw("8xh100")
    assert box.compute_jitter is None and box.sync_overhead_us is None
    layout = Layout("megatron", tp=8, microbatches=1, sequence_parallel=True)
    estimate = plan_layout(shape, layout, Workload(1, 1, 4096, "bf16-mixed"), box).estimate
    assert estimate.sync_wait_s == 0.0
