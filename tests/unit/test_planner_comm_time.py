"""Planner communication volumes, pipeline bubbles and step time, against published formulas and numbers."""

from __future__ import annotations

import dataclasses
import math

import pytest

from disttrain.planner import (
    Assumptions,
    Group,
    Layout,
    Workload,
    bubble_fraction,
    collective_bytes,
    comm_plan,
    count_shape,
    mfu_from_throughput,
    microbatches_in_flight,
    model_flops_per_token,
    model_shape,
    plan_layout,
)
from disttrain.planner.links import link_time
from disttrain.planner.shapes import hardware_flops_per_token
from disttrain.planner.step_time import model_flops
from tests.conftest import hw_profile as hw
from tests.conftest import model_preset as model


@pytest.mark.parametrize("n", [2, 8, 64])
def test_ring_collective_volumes(n: int) -> None:
    # All-reduce moves 2(n-1)/n of the buffer per rank, reduce-scatter and all-gather (n-1)/n (ZeRO sec. 7.1).
    group = Group(n, n)
    assert collective_bytes("all_reduce", 1000.0, group).intra == pytest.approx(2000.0 * (n - 1) / n)
    assert collective_bytes("reduce_scatter", 1000.0, group).intra == pytest.approx(1000.0 * (n - 1) / n)
    assert collective_bytes("all_gather", 1000.0, group).intra == pytest.approx(1000.0 * (n - 1) / n)


def test_zero_moves_one_and_a_half_times_data_parallel_volume() -> None:
    # Rajbhandari et al. 2020 sec. 7.2: P_os+g+p moves 3 Psi per rank (a reduce-scatter and two all-gathers), 1.5x
    # DDP's all-reduce. P_os and P_os+g would move 2 Psi (reduce-scatter + all-gather), but DeepSpeed's ZeRO-1/2
    # all-reduce each gradient bucket and keep their partition (use_multi_rank_bucket_allreduce, on by default; a
    # ZeRO-2 profile on gloo showed the all-reduce), then all-gather the updated partitions: 3 Psi as well.
    shape, box = count_shape(7_500_000_000, seq_len=1024), hw("2x8xh100")
    workload = Workload(1, 16, 1024, "bf16-true")  # 16-bit gradients everywhere, as in the paper

    def volume(layout: Layout) -> float:
        return comm_plan(shape, layout, workload, box).per_step(1).network

    ddp = volume(Layout("ddp", dp=16))
    assert ddp == pytest.approx(2 * 15 / 16 * 2 * shape.num_parameters)
    for stage in (1, 2, 3):
        assert volume(Layout("deepspeed", dp=16, zero_stage=stage)) == pytest.approx(1.5 * ddp)


@pytest.mark.parametrize(("model_name", "box_name"), [("llama-1b", "8xh100"), ("gpt2-124m", "2x8xh100")])
def test_onebit_adam_moves_a_thirtieth_of_ddps_bytes_after_backward(model_name: str, box_name: str) -> None:
    shape, box = model_shape(model(model_name)), hw(box_name)
    workload = Workload(1, 8, 1024, "bf16-mixed")
    dp = box.world_size
    ddp = comm_plan(shape, Layout("ddp", dp=dp), workload, box)
    onebit = comm_plan(shape, Layout("ddp", dp=dp, onebit_adam=True), workload, box)
    # Signs (1/8 byte) and one fp32 scale per 512 values, to the servers and back: each (n-1)/n of the buffer.
    exchange = dp * math.ceil(shape.num_parameters / (dp * 512)) * (64 + 4)
    assert onebit.per_step(1).network == pytest.approx(2 * (dp - 1) / dp * exchange)
    assert onebit.step_exposed == onebit.once_per_step()  # inside the optimizer step: nothing hides it
    assert onebit.step_bwd.network == 0
    ratio = onebit.per_step(1).network / ddp.per_step(1).network
    assert 1 / 33 < ratio < 1 / 28, ratio
    with pytest.raises(ValueError, match="DDP only"):
        Layout("fsdp", dp=dp, onebit_adam=True)


def test_traffic_is_split_by_link_class() -> None:
    shape, box = model_shape(model("llama-7b")), hw("2x8xh100")
    workload = Workload(1, 16, 4096, "bf16-mixed")
    ddp = comm_plan(shape, Layout("ddp", dp=16), workload, box).per_step(1)
    # A ring over 2 nodes x 8 GPUs leaves the node on one edge in 8.
    assert ddp.inter == pytest.approx(ddp.network / 8)
    single = comm_plan(shape, Layout("ddp", dp=8), workload, hw("8xh100")).per_step(1)
    assert single.inter == 0
    megatron = Layout("megatron", dp=2, tp=8, sequence_parallel=True, microbatches=8)
    plan = comm_plan(shape, megatron, workload, box)
    assert plan.mb_exposed.inter == 0  # tensor parallelism stays on NVLink
    assert plan.step_bwd.intra == 0 and plan.step_bwd.inter > 0  # dp peers sit on different nodes


def test_link_time_shares_the_node_network_between_its_gpus() -> None:
    box = hw("2x8xh100")
    traffic = collective_bytes("all_reduce", 8e9, Group(16, 8))
    nvlink = traffic.intra / 450e9
    network = traffic.inter * 8 / 400e9  # the node's 8 GPUs send at once through its 400 GB/s
    assert link_time(traffic, box, host_gbps=25.0) == pytest.approx(max(nvlink, network))


@pytest.mark.parametrize(("p", "m", "v"), [(2, 8, 2), (4, 16, 2), (8, 32, 4), (16, 64, 2)])
def test_bubble_fractions(p: int, m: int, v: int) -> None:
    # Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM")
    # sec. 2.2: bubble fraction (p-1)/m for GPipe and 1F1B, (p-1)/(v m) for the interleaved schedule.
    assert bubble_fraction("gpipe", p, m) == bubble_fraction("1f1b", p, m) == (p - 1) / m
    assert bubble_fraction("interleaved_1f1b", p, m, v) == (p - 1) / (v * m)
    assert bubble_fraction("zero_bubble", p, m, 2) == 0.0
    assert bubble_fraction("none", 1, m) == 0.0
    # Same bubble, fewer micro-batches in flight: 1F1B caps them at p on the first stage, GPipe keeps all m.
    assert microbatches_in_flight("gpipe", p, m, 1, stage=0) == m
    assert microbatches_in_flight("1f1b", p, m, 1, stage=0) == p
    assert microbatches_in_flight("1f1b", p, m, 1, stage=p - 1) == 1


def test_palm_540b_model_flops_utilization() -> None:
    # Chowdhery et al. 2022 (PaLM), sec. 4.1 / Table 3 and appendix B: 540B parameters (L = 118 layers, H = 48
    # heads, Q = 256 head dim, T = 2048) trained at 238.3K tokens/s on 6144 TPU v4 chips of 275 peak bf16
    # TFLOP/s is 46.2% MFU, with model FLOPs per token 6N + 12LHQT.
    flops = model_flops_per_token(540e9, n_layers=118, n_heads=48, head_dim=256, seq_len=2048)
    util = mfu_from_throughput(238.3e3, flops, num_devices=6144, peak_flops_per_device=275e12)
    assert util.mfu == pytest.approx(0.462, abs=0.001)
    assert util.hfu == util.mfu  # no hardware FLOPs given: nothing recomputed


def test_single_gpu_step_is_compute_at_the_achievable_fraction_of_peak_plus_the_optimizer() -> None:
    shape, box = model_shape(model("llama-1b")), hw("1xa100")
    workload = Workload(4, 4, 2048, "bf16-mixed")
    assumptions = Assumptions()
    # AdamW touches 7 fp32 values per parameter (read p, g, m, v; write p, m, v) at the A100's 2039 GB/s.
    optimizer = 7 * 4 * shape.num_parameters / 2039e9
    for recompute in ("none", "full"):
        got = plan_layout(shape, Layout("fsdp", dp=1, recompute=recompute), workload, box, assumptions).estimate
        flops = hardware_flops_per_token(shape, 2048, recompute)
        assert got.compute_s == pytest.approx(4 * 2048 * flops / (312e12 * assumptions.compute_efficiency))
        assert got.optimizer_step_s == pytest.approx(optimizer)
        assert got.exposed_comm_s == got.bubble_s == got.host_optimizer_s == 0.0
        assert got.step_time_s == pytest.approx(got.compute_s + optimizer)
        assert got.mfu == pytest.approx(4 * 2048 / got.step_time_s * model_flops(shape, 2048) / 312e12)
        assert got.hfu == pytest.approx(got.mfu * flops / model_flops(shape, 2048))


def test_ddp_all_reduce_is_hidden_behind_backward_up_to_the_overlap_fraction() -> None:
    shape, box = model_shape(model("llama-1b")), hw("8xa100")
    assumptions = Assumptions()
    rate = 312e12 * assumptions.compute_efficiency
    all_reduce = 2 * 7 / 8 * 4 * shape.num_parameters / 300e9  # fp32 gradients over 300 GB/s NVLink
    for micro in (1, 16):
        workload = Workload(micro, 8 * micro, 2048, "bf16-mixed")
        got = plan_layout(shape, Layout("ddp", dp=8), workload, box, assumptions)
        backward = micro * 2048 * 2 / 3 * model_flops(shape, 2048) / rate
        exposed = max(0.0, all_reduce - assumptions.comm_overlap * backward)
        assert got.estimate.exposed_comm_s == pytest.approx(exposed)
        step = got.estimate.compute_s + exposed + got.estimate.optimizer_step_s
        assert got.step_time_s == pytest.approx(step)
    assert exposed == 0.0  # at 16 sequences per GPU backward hides the all-reduce entirely


def test_pipeline_schedules_trade_bubble_for_nothing_else_in_time() -> None:
    shape, box = model_shape(model("llama-13b")), hw("8xa100")
    workload = Workload(1, 32, 4096, "bf16-mixed")
    base = Layout("megatron", dp=1, tp=2, pp=4, microbatches=32, sequence_parallel=True, schedule="1f1b")
    times = {}
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)):
        layout = dataclasses.replace(base, schedule=schedule, virtual_stages=v)
        times[schedule] = plan_layout(shape, layout, workload, box).estimate
    assert times["gpipe"].step_time_s == pytest.approx(times["1f1b"].step_time_s)
    assert times["1f1b"].bubble_fraction == pytest.approx(3 / 32)
    assert times["interleaved_1f1b"].bubble_fraction == pytest.approx(3 / 64)
    assert times["zero_bubble"].step_time_s < times["interleaved_1f1b"].step_time_s < times["1f1b"].step_time_s


def test_megatron_without_pipelining_gathers_weights_every_micro_batch() -> None:
    """strategy=megatron at pp=1 reshards blocks after forward (FSDP2 as strategy=fsdp): per micro-batch the weights
    are gathered for forward and the blocks again for backward; under pipelining they stay gathered all step."""
    from disttrain.planner.comm import process_groups

    shape = model_shape(model("llama-7b"))
    workload = Workload(1, 16, 4096, "bf16-mixed")
    flat = Layout("megatron", dp=4, tp=2, microbatches=4)
    comm = comm_plan(shape, flat, workload, hw("8xa100"))
    group = process_groups(flat, hw("8xa100"))["dp_shard"]
    slice_ = shape.stage_parameters(2, 1, 0)
    units = shape.n_layers + 1  # one all-gather call per block, then the root
    assert comm.mb_fwd == collective_bytes("all_gather", 2 * slice_, group, units)
    assert comm.mb_bwd == collective_bytes(
        "all_gather", 2 * shape.n_layers * shape.block_tp_numel(2), group, shape.n_layers
    )
    assert comm.step_fwd.network == 0
    piped = Layout("megatron", dp=2, tp=2, pp=2, microbatches=8, schedule="1f1b")
    assert comm_plan(shape, piped, workload, hw("8xa100")).mb_fwd.network == 0


@pytest.mark.parametrize(("preset", "per_layer"), [("gpt-nano", 6), ("llama-7b", 7)])
def test_tensor_parallel_activation_collectives_as_the_engine_issues_them(preset: str, per_layer: int) -> None:
    """Forward: the two row-parallel outputs. Backward: one per column-parallel input projection (q, k, v, w1, and
    w3 under SwiGLU), since each module sums its own input gradient. Plus the vocab-parallel embedding output and
    the LM head's input gradient, and the vocab-parallel loss's three per-token reductions (tests/fake counts them
    on the engine itself)."""
    from disttrain.planner.comm import process_groups

    shape = model_shape(model(preset))
    workload = Workload(2, 4, shape.seq_len, "fp32")
    layout = Layout("megatron", dp=1, tp=2, microbatches=2)
    activation = 2 * shape.seq_len * shape.d_model * 4
    group = process_groups(layout, hw("8xa100"))["tp"]
    # DTensor issues them as functional collectives, which a calibration prices on their own
    expected = collective_bytes("functional_all_reduce", activation, group).scale(per_layer * shape.n_layers + 2)
    expected += collective_bytes("functional_all_reduce", 2 * shape.seq_len * 4, group).scale(3)
    assert comm_plan(shape, layout, workload, hw("8xa100")).mb_exposed == expected


def test_tp_collectives_take_the_functional_all_reduce_figures_else_the_all_reduce_ones() -> None:
    cpu = dataclasses.replace(hw("cpu"), intra_node_bandwidth_gbps=4.0, intra_node_latency_us=100.0)
    tp = collective_bytes("functional_all_reduce", 1e6, Group(2, 2), calls=10)
    assert tp.intra == collective_bytes("all_reduce", 1e6, Group(2, 2)).intra  # an all-reduce's volume
    assert link_time(tp, cpu, 25.0) == pytest.approx(1e6 / 4e9 + 10 * 100e-6)  # the link's figures
    measured_ar = dataclasses.replace(
        cpu,
        collective_busbw_gbps={"intra_node.all_reduce": 2.0},
        collective_latency_us={"intra_node.all_reduce": 200.0},
    )
    assert link_time(tp, measured_ar, 25.0) == pytest.approx(1e6 / 2e9 + 10 * 200e-6)  # the all-reduce's own
    measured_f = dataclasses.replace(
        measured_ar,
        collective_busbw_gbps={**measured_ar.collective_busbw_gbps, "intra_node.functional_all_reduce": 1.0},
        collective_latency_us={**measured_ar.collective_latency_us, "intra_node.functional_all_reduce": 400.0},
    )
    assert link_time(tp, measured_f, 25.0) == pytest.approx(1e6 / 1e9 + 10 * 400e-6)  # its own, once measured


def test_every_collective_call_pays_its_links_latency_once() -> None:
    """Bytes over bandwidth, plus calls x latency per link class; FSDP2 issues one call per unit (block or root)."""
    cpu = dataclasses.replace(hw("cpu"), intra_node_bandwidth_gbps=1.0, intra_node_latency_us=500.0)
    group = Group(2, 2)
    one = collective_bytes("all_gather", 1e6, group)
    many = collective_bytes("all_gather", 1e6, group, calls=10)
    assert (one.intra_calls, many.intra_calls) == (1, 10) and one.intra == many.intra
    assert link_time(many, cpu, 25.0) - link_time(one, cpu, 25.0) == pytest.approx(9 * 500e-6)
    assert link_time(one.scale(3), cpu, 25.0) == pytest.approx(3 * (0.5e6 / 1e9 + 500e-6))
    shape = model_shape(model("gpt-nano"))
    fsdp = comm_plan(shape, Layout("fsdp", dp=2), Workload(4, 8, shape.seq_len, "fp32"), cpu)
    assert fsdp.mb_fwd.intra_calls == shape.n_layers + 1  # blocks, then the root
    assert fsdp.mb_bwd.intra_calls == 2 * shape.n_layers + 1  # the blocks' re-gathers and every reduce-scatter


@pytest.mark.parametrize(
    ("layout", "once", "tp_share", "reduction"),
    [
        (Layout("ddp", dp=8, microbatches=4), 1.0, 0.0, 1.0),  # one gradient all-reduce after the last micro-batch
        # bf16 weights gathered before forward and again before backward (2 + 2 bytes), fp32 gradients reduced (4)
        (Layout("fsdp", dp=8, microbatches=4), 0.0, 0.0, 0.5),
        (Layout("deepspeed", dp=8, zero_stage=1, microbatches=4), 1.0, 0.0, 2 / 3),  # bf16 all-reduce, bf16 gather
        (Layout("deepspeed", dp=8, zero_stage=3, microbatches=4), 0.0, 0.0, 1 / 3),  # two gathers, one reduce
        (Layout("megatron", dp=1, tp=8, microbatches=32), 0.0, 1.0, 0.0),  # only activations move
    ],
)
def test_comm_shares_say_what_moves_once_per_step_what_tensor_parallelism_moves_and_what_gradients_do(
    layout: Layout, once: float, tp_share: float, reduction: float
) -> None:
    """What the report's levers read (run.json ``comm_shares``): accumulation shrinks per token only the
    once-per-step part, a smaller tp only tensor parallelism's, a half-precision reduction only the gradients'."""
    shape = model_shape(model("llama-1b"))
    candidate = plan_layout(shape, layout, Workload(1, 32, 2048, "bf16-mixed"), hw("8xh100"))
    shares = candidate.comm_shares
    assert (shares["once_per_step"], shares["tensor_parallel"]) == (once, tp_share)
    # By bytes; FSDP's root unit (embedding, head) is not gathered again for backward, and each call pays latency.
    assert shares["gradient_reduction"] == pytest.approx(reduction, abs=0.05)


def test_comm_shares_of_zero2_and_tp_with_data_parallelism_follow_their_bytes() -> None:
    """ZeRO-2 reduces every micro-batch and gathers once: at accumulation a the once-only all-gather (bf16 params,
    half the bytes of the bf16 gradients' all-reduce) is 1/(1+2a) of the bytes. tp=2 x dp=4: tp's share is its
    all-reduce time over the step's, computed here from the plan's own traffic."""
    shape = model_shape(model("llama-1b"))
    work, profile = Workload(1, 32, 2048, "bf16-mixed"), hw("8xh100")
    zero2 = plan_layout(shape, Layout("deepspeed", dp=8, zero_stage=2, microbatches=4), work, profile)
    assert zero2.comm_shares["once_per_step"] == pytest.approx(1 / 9, abs=0.01)
    layout = Layout("megatron", dp=4, tp=2, microbatches=8)
    tp_dp = plan_layout(shape, layout, work, profile)
    traffic = comm_plan(shape, layout, work, profile)
    host = Assumptions().host_link_gbps
    whole = link_time(traffic.per_step(8), profile, host)
    assert tp_dp.comm_shares["tensor_parallel"] == pytest.approx(
        link_time(traffic.mb_tp.scale(8), profile, host) / whole, abs=1e-3
    )
    assert tp_dp.comm_shares["once_per_step"] == pytest.approx(
        link_time(traffic.once_per_step(), profile, host) / whole, abs=1e-3
    )
    assert 0.3 < tp_dp.comm_shares["tensor_parallel"] < 0.9 and tp_dp.comm_shares["once_per_step"] < 0.2
