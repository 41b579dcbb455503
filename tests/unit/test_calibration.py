"""Calibration read back from telemetry, the planner's calibrated profile, and predicted-vs-measured errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from diagnostics.calibration import (
    CALIBRATION_FILE,
    Calibration,
    calibration_from_telemetry,
    read_calibration,
    write_calibration,
)
from diagnostics.collect.state_bytes import training_state_bytes
from diagnostics.prediction import compare, comparison_rows, one_line
from diagnostics.telemetry import TelemetryWriter, telemetry_path
from disttrain.config.calibration import load_calibration
from disttrain.config.errors import ConfigError
from disttrain.config.hardware import CALIBRATED_SCALARS, HardwareProfile, validate_profile
from disttrain.planner.calibrated import assumptions_for, calibrated_profile
from disttrain.planner.plan import DEFAULT_ASSUMPTIONS
from tests.conftest import hw_profile


def write_calibration_run(run_dir: Path, *, torn: bool = False) -> None:
    for rank, (start, end, busbw, memory) in enumerate([(1.0e11, 1.2e11, 4.0, 10.0), (0.8e11, 0.9e11, 6.0, 12.0)]):
        w = TelemetryWriter(run_dir, rank)
        w.write("meta", device="cpu", hw="cpu")
        w.write("calibration", when="start", dtype="fp32", matrix_size=512, flops_per_s=start, seconds=0.3)
        w.write("memory_calibration", bandwidth_gbps=memory)
        for op, factor in (("all_reduce", 1.0), ("all_gather", 2.0), ("reduce_scatter", 3.0)):
            w.write(
                "link_calibration", link="intra_node", op=op, ranks=2, bytes=8 << 20, seconds=0.01,
                algbw_gbps=busbw, busbw_gbps=busbw * factor, latency_us=100.0 * factor * (rank + 1),
            )  # fmt: skip
        # the call takes 1 ms after compute (0.5 ms warm); rank 0 arrives first in rounds 1 and 2 and waits 3 ms
        # more, rank 1 in round 3 (1.5 ms more)
        waits = [0.004, 0.004, 0.001] if rank == 0 else [0.001, 0.001, 0.0025]
        w.write(
            "sync_calibration", ranks=2, rounds=3, segment_s=0.004, wait_s=sum(waits) / 3, waits_s=waits,
            latency_s=0.0005,
        )  # fmt: skip
        w.write("overlap_calibration", ranks=2, bytes=8 << 20, compute_s=0.01, comm_s=0.01, both_s=0.02, hidden=0.0)
        w.write("tp_calibration", ranks=2, plain_pair_s=1e-4, parallel_pair_s=1.7e-3, overhead_us=800.0)
        w.write("calibration", when="end", dtype="fp32", matrix_size=512, flops_per_s=end, seconds=0.3)
        w.close()
    if torn:
        with telemetry_path(run_dir, 1).open("a") as f:
            f.write('{"kind": "calibration", "dtype"')


def test_each_rank_keeps_its_best_matmul_rate_and_the_run_takes_the_median(tmp_path: Path) -> None:
    write_calibration_run(tmp_path, torn=True)
    cal = calibration_from_telemetry(tmp_path)
    assert cal.accelerator == "cpu"  # the device class its figures describe, from the ranks' meta records
    assert cal.matmul_flops_per_s == {"fp32": pytest.approx((1.2e11 + 0.9e11) / 2)}
    assert cal.memory_bandwidth_gbps == pytest.approx(11.0)
    assert cal.links["intra_node"] == pytest.approx({"all_reduce": 5.0, "all_gather": 10.0, "reduce_scatter": 15.0})
    assert cal.bus_bandwidth_gbps("intra_node") == pytest.approx(10.0)  # the median over the three collectives
    assert cal.bus_bandwidth_gbps("inter_node") is None
    assert cal.latency_us == {"intra_node": pytest.approx(250.0)}  # median of every rank's and op's: 100..600
    # per collective: the median over the ranks' 100/200, 200/400, 300/600
    assert cal.op_latency_us == {
        "intra_node": pytest.approx({"all_reduce": 150.0, "all_gather": 300.0, "reduce_scatter": 450.0})
    }
    # the last rank's wait is the call: 1 ms, 0.5 ms over the warm one; the others' extra wait, (3 + 3 + 1.5) ms
    # over 6 rank-rounds, is sigma x sqrt(4 ms) x E[max of 2 normals]
    assert cal.sync_overhead_us == pytest.approx(500.0)
    assert cal.compute_jitter == pytest.approx(0.0075 / 6 / (0.004**0.5 * 0.5642))
    assert cal.ranks == 2


def test_a_tp_runs_functional_all_reduce_is_priced_on_its_own_not_in_the_links_figure(tmp_path: Path) -> None:
    write_calibration_run(tmp_path)
    before = calibration_from_telemetry(tmp_path)
    for rank in (0, 1):
        w = TelemetryWriter(tmp_path, rank)
        w.write(
            "link_calibration", link="intra_node", op="functional_all_reduce", ranks=2, bytes=8 << 20,
            seconds=0.02, algbw_gbps=0.5, busbw_gbps=0.5, latency_us=900.0,
        )  # fmt: skip
        w.close()
    cal = calibration_from_telemetry(tmp_path)
    assert cal.links["intra_node"]["functional_all_reduce"] == pytest.approx(0.5)
    assert cal.op_latency_us["intra_node"]["functional_all_reduce"] == pytest.approx(900.0)
    assert cal.bus_bandwidth_gbps("intra_node") == before.bus_bandwidth_gbps("intra_node")
    assert cal.latency_us == before.latency_us
    profile = calibrated_profile(hw_profile("cpu"), cal, "fp32")
    assert profile.hw.collective_busbw_gbps["intra_node.functional_all_reduce"] == pytest.approx(0.5)
    validate_profile(profile.hw)  # a known op name


def test_calibration_file_round_trips_and_bad_paths_name_the_key(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_calibration_run(run)
    written = write_calibration(run)
    assert written is not None and (run / CALIBRATION_FILE).is_file()
    assert read_calibration(run) == written == read_calibration(run / CALIBRATION_FILE)
    (tmp_path / "empty").mkdir()
    assert write_calibration(tmp_path / "empty") is None
    with pytest.raises(ConfigError, match=r"calibration: .*no calibration records"):
        load_calibration(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"calibration: .*neither a run directory"):
        load_calibration(str(tmp_path / "missing"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a calibration file"):
        load_calibration(str(tmp_path / "bad.json"))


def test_calibrated_profile_replaces_what_was_measured_and_says_so() -> None:
    cal = Calibration(
        matmul_flops_per_s={"bf16": 2.0e14},
        memory_bandwidth_gbps=1500.0,
        links={"intra_node": {"all_reduce": 100.0}, "inter_node": {"all_reduce": 20.0}},
        latency_us={"intra_node": 8.0, "inter_node": 25.0},
        op_latency_us={"intra_node": {"all_reduce": 6.0, "all_gather": 10.0}},
        sync_overhead_us=3.0,
        compute_jitter=0.01,
        comm_overlap=0.9,
        tp_linear_overhead_us=50.0,
        tp_edge_overhead_us=9000.0,
        tp_step_overhead_us=3000.0,
        fsdp_unit_overhead_us=700.0,
        fsdp_copy_ns_per_byte=0.5,
        fsdp_step_tensor_us=160.0,
        fsdp_step_fixed_us=900.0,
        zero_backward_fixed_us=1000.0,
        zero_backward_ns_per_byte=3.0,
        zero_step_fixed_us=1200.0,
        zero_step_ns_per_byte=0.1,
        loop_overhead_us=6000.0,
        source="RUN",
    )
    a100 = hw_profile("2x8xh100")
    profile = calibrated_profile(a100, cal, "bf16")
    assert profile.hw.peak_flops("bf16") == pytest.approx(2.0e14)
    assert profile.hw.hbm_bandwidth_gbps == 1500.0
    assert profile.hw.intra_node_bandwidth_gbps == 100.0
    assert profile.hw.inter_node_bandwidth_gbps == 20.0  # a world group's bus bandwidth is the per-node figure
    assert (profile.hw.intra_node_latency_us, profile.hw.inter_node_latency_us) == (8.0, 25.0)
    assert profile.hw.collective_busbw_gbps == {"intra_node.all_reduce": 100.0, "inter_node.all_reduce": 20.0}
    assert profile.hw.collective_latency_us == {"intra_node.all_reduce": 6.0, "intra_node.all_gather": 10.0}
    assert (profile.hw.sync_overhead_us, profile.hw.compute_jitter) == (3.0, 0.01)
    assert (profile.hw.comm_overlap, profile.hw.tp_linear_overhead_us) == (0.9, 50.0)
    assert (profile.hw.fsdp_unit_overhead_us, profile.hw.fsdp_copy_ns_per_byte) == (700.0, 0.5)
    assert (profile.hw.fsdp_step_tensor_us, profile.hw.fsdp_step_fixed_us) == (160.0, 900.0)
    assert (profile.hw.zero_backward_fixed_us, profile.hw.zero_backward_ns_per_byte) == (1000.0, 3.0)
    assert (profile.hw.zero_step_fixed_us, profile.hw.zero_step_ns_per_byte) == (1200.0, 0.1)
    assert (profile.hw.tp_edge_overhead_us, profile.hw.tp_step_overhead_us) == (9000.0, 3000.0)
    assert profile.hw.loop_overhead_us == 6000.0
    assert set(profile.sources.values()) == {"measured"}
    assert assumptions_for(profile).compute_efficiency == DEFAULT_ASSUMPTIONS.calibrated_compute_efficiency
    datasheet = calibrated_profile(a100, Calibration(matmul_flops_per_s={"fp32": 1e13}), "bf16")
    assert datasheet.hw == a100 and datasheet.sources["peak_tflops"] == "datasheet"
    assert assumptions_for(datasheet) == DEFAULT_ASSUMPTIONS
    cpu = calibrated_profile(hw_profile("cpu"), None, "fp32")
    assert set(cpu.sources) == {
        "peak_tflops",
        "hbm_bandwidth_gbps",
        "intra_node_bandwidth_gbps",
        "inter_node_bandwidth_gbps",
        "intra_node_latency_us",
        "inter_node_latency_us",
        "collective_busbw_gbps",
        "collective_latency_us",
        *CALIBRATED_SCALARS,
    }
    assert set(cpu.sources.values()) == {"none"}


def test_a_calibration_from_another_device_class_is_refused_naming_the_key(tmp_path: Path) -> None:
    """A CPU run's memory bandwidth, links, sync waits and loop would stand in for a GPU's: refused, not mixed."""
    write_calibration_run(tmp_path)
    assert load_calibration(str(tmp_path), hw_profile("cpu")).accelerator == "cpu"
    with pytest.raises(ConfigError, match=r"calibration: .* measured on cpu, and hw=8xh100 is a gpu profile"):
        load_calibration(str(tmp_path), hw_profile("8xh100"))
    gpu = tmp_path / "gpu"
    writer = TelemetryWriter(gpu, 0)
    writer.write("meta", device="cuda:0")
    writer.write("memory_calibration", bandwidth_gbps=3000.0)
    writer.close()
    assert load_calibration(str(gpu), hw_profile("8xh100")).accelerator == "gpu"
    with pytest.raises(ConfigError, match=r"pass a run on a cpu machine"):
        load_calibration(str(gpu), hw_profile("cpu"))
    older = tmp_path / "calibration.json"  # written before the device class was recorded: taken as it is
    older.write_text(json.dumps({"memory_bandwidth_gbps": 12.0}))
    assert load_calibration(str(older), hw_profile("8xh100")).accelerator is None


def test_every_figure_calibration_shares_with_the_hw_profile_is_substituted_by_name() -> None:
    shared = {f.name for f in dataclasses.fields(Calibration)} & {f.name for f in dataclasses.fields(HardwareProfile)}
    assert set(CALIBRATED_SCALARS) == shared - {"source", "accelerator"}
    cal = Calibration(**{name: 0.01 * (i + 1) for i, name in enumerate(CALIBRATED_SCALARS)})
    profile = calibrated_profile(hw_profile("cpu"), cal, "fp32")
    for i, name in enumerate(CALIBRATED_SCALARS):
        assert (getattr(profile.hw, name), profile.sources[name]) == (0.01 * (i + 1), "measured")


def test_errors_are_predicted_over_measured_and_rows_show_what_either_side_has() -> None:
    record = {
        "basis": {"peak_tflops": "measured"},
        "predicted": {"step_time_s": 0.12, "comm_s": 0.02, "state_bytes": 3 * 2**30, "mfu": 0.4},
        "measured": {"step_time_s": 0.10, "comm_s": 0.04, "state_bytes": 3 * 2**30, "tokens_per_s": 1000.0},
    }
    errors = compare(record["predicted"], record["measured"])
    assert errors == pytest.approx({"step_time_s": 0.2, "comm_s": -0.5, "state_bytes": 0.0})
    rows = {r[0]: r[1:] for r in comparison_rows(record)}
    assert rows["step time"] == ("120.0 ms", "100.0 ms", "+20%")
    assert rows["tokens/s"] == ("n/a", "1,000", "n/a")
    line = one_line(record)
    assert line.startswith("planner (calibrated) predicted vs measured: step time 120.0 ms vs 100.0 ms (+20%)")
    assert "communication per step 20.0 ms vs 40.0 ms (-50%)" in line
    assert one_line({"unpredicted": "no peak"}) == "planner: step time not predicted: no peak"


def test_training_state_counts_parameters_gradients_and_adam_states_once() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=True))
    model[1].weight = model[0].weight  # tied: one storage
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    params = sum(p.numel() * 4 for p in model.parameters())  # the tied weight once: parameters() dedups
    steps = sum(s["step"].untyped_storage().nbytes() for s in optimizer.state.values())
    # parameters, their gradients, Adam's two moments, and its step counters
    assert training_state_bytes(model, [optimizer]) == 4 * params + steps
    assert training_state_bytes(model, []) == 2 * params


def test_prediction_is_read_back_into_the_sweep_row(tmp_path: Path) -> None:
    from diagnostics.report.sweep import load_run
    from diagnostics.report.sweep_render import _planner

    run = tmp_path / "0"
    run.mkdir()
    record = {
        "predicted": {"step_time_s": 0.11, "state_bytes": 100},
        "measured": {"step_time_s": 0.1, "state_bytes": 80},
    }
    (run / "run.json").write_text(json.dumps({"status": "completed", "result": {}, "prediction": record}))
    assert _planner(load_run(tmp_path, run)) == "step +10%, state +25%"


def test_the_plan_table_says_which_numbers_are_datasheet_measured_or_missing() -> None:
    from disttrain.planner.render import sources_line

    datasheet = calibrated_profile(hw_profile("8xh100"), None, "bf16").sources
    assert sources_line(datasheet) == (
        "hw numbers: peak_tflops datasheet, hbm_bandwidth_gbps datasheet, intra_node_bandwidth_gbps datasheet, "
        "inter_node_bandwidth_gbps datasheet; not modelled: intra_node_latency_us, inter_node_latency_us, "
        "sync_overhead_us, compute_jitter, tp_linear_overhead_us, tp_edge_overhead_us, tp_step_overhead_us, "
        "fsdp_unit_overhead_us, fsdp_copy_ns_per_byte, fsdp_step_tensor_us, fsdp_step_fixed_us, "
        "zero_backward_fixed_us, zero_backward_ns_per_byte, zero_step_fixed_us, zero_step_ns_per_byte, "
        "loop_overhead_us"
    )
    measured = calibrated_profile(hw_profile("cpu"), Calibration(matmul_flops_per_s={"fp32": 1e10}), "fp32").sources
    assert sources_line(measured).startswith("hw numbers: peak_tflops measured; not modelled: hbm_bandwidth_gbps")


def test_pipeline_sends_and_receives_are_not_compared_with_the_predicted_link_time() -> None:
    """A stage's sends and receives last as long as it waits for its neighbour (the bubble): a zero-bubble pp=2
    run compared 16.7 ms predicted with 416.9 ms of them. Collectives alone (no pipeline) are compared."""
    from types import SimpleNamespace

    from diagnostics.prediction import measured_from_analysis

    summary = SimpleNamespace(step_time={"p50": 0.5}, tokens_per_s=1000.0)

    def analysis(collective_share: float) -> SimpleNamespace:
        phases = [SimpleNamespace(profile_comm_s=0.4, profile_collective_share=collective_share,
                                  peak_allocated_bytes=None, training_state_bytes=None)]  # fmt: skip
        return SimpleNamespace(summary=summary, phases=phases)

    assert measured_from_analysis(analysis(1.0), {})["comm_s"] == 0.4  # type: ignore[arg-type]
    assert "comm_s" not in measured_from_analysis(analysis(0.1), {})  # type: ignore[arg-type]
