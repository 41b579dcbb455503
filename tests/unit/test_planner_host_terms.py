"""Host-side terms calibration measures: how much of an overlappable collective compute hides (``comm_overlap``),
the host cost of each tensor-parallel (DTensor) module (``tp_linear_overhead_us``), and a matmul rate on the CPU
clock of the compute (what the cores do, not the share other processes leave them)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

from diagnostics.calibration import calibration_from_telemetry
from diagnostics.collect.calibrate import compute_clock
from diagnostics.telemetry import TelemetryWriter
from disttrain.config.errors import ConfigError
from disttrain.config.hardware import validate_profile
from disttrain.planner import Layout, Workload, comm_plan, model_shape, plan_layout
from disttrain.planner.calibrated import calibrated_profile
from disttrain.planner.comm import link_time, tp_parallel_linears_per_layer
from disttrain.planner.plan import DEFAULT_ASSUMPTIONS
from disttrain.planner.step_time import tp_dispatch_seconds
from tests.conftest import hw_profile as hw
from tests.conftest import model_preset as model

# A CPU box as a calibration describes it (no sync terms, so each test sees only the term it checks).
CPU = dataclasses.replace(
    hw("cpu"),
    peak_tflops={"fp32": 0.05},
    hbm_bandwidth_gbps=20.0,
    intra_node_bandwidth_gbps=1.0,
    intra_node_latency_us=200.0,
)
WORK = Workload(global_batch_size=32, micro_batch_size=16, seq_len=128, precision="fp32")


def test_tp_modules_per_layer_and_their_host_seconds() -> None:
    assert tp_parallel_linears_per_layer(swiglu=False) == 6  # q, k, v, o, w1, w2
    assert tp_parallel_linears_per_layer(swiglu=True) == 7  # and w3
    assert tp_dispatch_seconds(26, 800.0) == pytest.approx(26 * 0.8e-3)
    assert tp_dispatch_seconds(26, None) == 0.0  # not measured: not modelled (a GPU's host runs ahead)
    nano, llama = model_shape(model("gpt-nano")), model_shape(model("llama-7b"))
    # gpt-nano, tp=2: 4 blocks x 6 + the vocab-parallel embedding + the column-parallel head
    assert comm_plan(nano, Layout("megatron", tp=2), WORK, CPU).mb_tp_modules == 26
    # pp=2: the busiest stage has 2 blocks and one of the two edge modules; tp=1 has none
    assert (
        comm_plan(nano, Layout("megatron", tp=2, pp=2, microbatches=2, schedule="1f1b"), WORK, CPU).mb_tp_modules == 13
    )
    assert comm_plan(nano, Layout("megatron", dp=2), WORK, CPU).mb_tp_modules == 0
    assert comm_plan(nano, Layout("fsdp", dp=2), WORK, CPU).mb_tp_modules == 0
    assert comm_plan(llama, Layout("megatron", tp=8), WORK, hw("8xa100")).mb_tp_modules == 32 * 7 + 2


def test_the_measured_tp_overhead_lengthens_each_micro_batch_of_a_tp_layout_only() -> None:
    nano = model_shape(model("gpt-nano"))
    measured = dataclasses.replace(CPU, tp_linear_overhead_us=800.0)
    tp2 = Layout("megatron", tp=2, microbatches=2)  # global batch 32 = 2 micro-batches of 16 on the one dp rank
    before, after = plan_layout(nano, tp2, WORK, CPU).estimate, plan_layout(nano, tp2, WORK, measured).estimate
    assert before.host_dispatch_s == 0.0
    assert after.host_dispatch_s == pytest.approx(2 * 26 * 0.8e-3)
    assert after.step_time_s - before.step_time_s == pytest.approx(2 * 26 * 0.8e-3)
    ddp = Layout("ddp", dp=2)
    assert plan_layout(nano, ddp, WORK, measured).estimate == plan_layout(nano, ddp, WORK, CPU).estimate


def test_a_measured_overlap_replaces_the_assumed_one_for_hidden_collectives() -> None:
    nano = model_shape(model("gpt-nano"))
    fsdp = Layout("fsdp", dp=2)
    comm = comm_plan(nano, fsdp, WORK, CPU)
    assert comm.mb_exposed.network == 0 and comm.mb_fwd.network > 0 and comm.mb_bwd.network > 0
    est = plan_layout(nano, fsdp, WORK, CPU).estimate
    fwd, bwd = link_time(comm.mb_fwd, CPU, 25.0), link_time(comm.mb_bwd, CPU, 25.0)
    # one micro-batch: a third of its FLOPs in forward (2N of 6N), the rest in backward
    forward = est.compute_s / 3
    backward = est.compute_s - forward
    assumed = max(0.0, fwd - 0.8 * forward) + max(0.0, bwd - 0.8 * backward)
    assert est.exposed_comm_s == pytest.approx(assumed)
    none_hidden = plan_layout(nano, fsdp, WORK, dataclasses.replace(CPU, comm_overlap=0.0)).estimate
    assert none_hidden.exposed_comm_s == pytest.approx(fwd + bwd)  # gloo's threads share the compute's cores
    assert none_hidden.step_time_s - est.step_time_s == pytest.approx(fwd + bwd - assumed)
    half = plan_layout(nano, fsdp, WORK, dataclasses.replace(CPU, comm_overlap=0.5)).estimate
    assert half.exposed_comm_s == pytest.approx(max(0.0, fwd - 0.5 * forward) + max(0.0, bwd - 0.5 * backward))
    # DDP's one gradient all-reduce is hidden behind backward too: measured 0, it is all exposed
    ddp = Layout("ddp", dp=2)
    all_reduce = link_time(comm_plan(nano, ddp, WORK, CPU).step_bwd, CPU, 25.0)
    exposed = plan_layout(nano, ddp, WORK, dataclasses.replace(CPU, comm_overlap=0.0)).estimate.exposed_comm_s
    assert exposed == pytest.approx(all_reduce) and all_reduce > 0
    with pytest.raises(ConfigError, match=r"hw.comm_overlap: must be in \[0, 1\], got 1.5"):
        validate_profile(dataclasses.replace(CPU, comm_overlap=1.5))
    with pytest.raises(ConfigError, match=r"hw.tp_linear_overhead_us: must be >= 0"):
        validate_profile(dataclasses.replace(CPU, tp_linear_overhead_us=-1.0))
    assert DEFAULT_ASSUMPTIONS.comm_overlap == 0.8


def test_overlap_and_tp_overhead_are_read_back_and_substituted(tmp_path: Path) -> None:
    for rank, (hidden, overhead) in enumerate([(0.0, 700.0), (0.1, 900.0)]):
        w = TelemetryWriter(tmp_path, rank)
        w.write("calibration", when="start", dtype="fp32", matrix_size=512, flops_per_s=9e10, seconds=0.15)
        w.write("overlap_calibration", ranks=2, bytes=8 << 20, compute_s=0.01, comm_s=0.01, both_s=0.02, hidden=hidden)
        w.write("tp_calibration", ranks=2, plain_pair_s=1e-4, parallel_pair_s=1.6e-3, overhead_us=overhead)
        w.write("overlap_calibration", ranks=2, hidden=1.7)  # out of range: ignored
        w.close()
    cal = calibration_from_telemetry(tmp_path)
    assert cal.comm_overlap == pytest.approx(0.05) and cal.tp_linear_overhead_us == pytest.approx(800.0)
    profile = calibrated_profile(hw("cpu"), cal, "fp32")
    assert (profile.hw.comm_overlap, profile.hw.tp_linear_overhead_us) == (pytest.approx(0.05), pytest.approx(800.0))
    assert profile.sources["comm_overlap"] == profile.sources["tp_linear_overhead_us"] == "measured"
    bare = calibrated_profile(hw("cpu"), None, "fp32")
    assert bare.sources["comm_overlap"] == bare.sources["tp_linear_overhead_us"] == "none"


def test_the_cpu_matmul_clock_does_not_count_time_the_process_is_not_running() -> None:
    name, clock = compute_clock(torch.device("cpu"))
    assert name in ("thread_cpu", "process_cpu")
    start = clock()
    time.sleep(0.2)  # descheduled (as under another process's load): no compute time passes
    assert clock() - start < 0.05
    start = clock()
    deadline = time.perf_counter() + 10.0
    while clock() - start < 0.02 and time.perf_counter() < deadline:  # busy: CPU time passes, however loaded
        pass
    assert clock() - start >= 0.02


def test_a_cpu_host_hides_collectives_only_with_a_spare_core_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from diagnostics.collect import calibrate

    cpu = torch.device("cpu")
    monkeypatch.setattr(calibrate.os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
    monkeypatch.setattr(calibrate.torch, "get_num_threads", lambda: 1)
    this_box = calibrate.comm_overlap(None, 8 << 20, cpu, local_ranks=2)  # a rank per core: gloo takes compute's
    assert (this_box["method"], this_box["hidden"]) == ("spare_cores", 0.0)
    assert calibrate.comm_overlap(None, 8 << 20, cpu, local_ranks=1)["hidden"] == 1.0  # a whole core spare
    monkeypatch.setattr(calibrate.os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    assert calibrate.comm_overlap(None, 8 << 20, cpu, local_ranks=4)["hidden"] == pytest.approx(0.5)  # 1.5 - 1
    monkeypatch.setattr(calibrate.torch, "get_num_threads", lambda: 3)
    assert calibrate.comm_overlap(None, 8 << 20, cpu, local_ranks=2)["hidden"] == 0.0  # 3 cores, 3 threads each
