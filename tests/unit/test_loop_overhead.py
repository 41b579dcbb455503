"""The time a step spends outside its phases (data wait, the training loop's hooks, callbacks, logging): read from a
run's step records as ``loop_overhead_us`` and added once to every layout's predicted step."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from diagnostics.calibration import calibration_from_telemetry, loop_overhead_us
from diagnostics.telemetry import TelemetryWriter
from disttrain.config.errors import ConfigError
from disttrain.config.hardware import validate_profile
from disttrain.planner import Workload, candidate_layouts, model_shape, plan_layout
from disttrain.planner.calibrated import calibrated_profile
from tests.conftest import hw_profile as hw
from tests.conftest import model_preset as model

CPU = dataclasses.replace(hw("cpu"), peak_tflops={"fp32": 0.05}, hbm_bandwidth_gbps=20.0, intra_node_bandwidth_gbps=1.0)


def _write_steps(run_dir: Path, rank: int, loops: list[tuple[float | None, float | None]], device: str = "cpu") -> None:
    writer = TelemetryWriter(run_dir, rank)
    writer.write("meta", device=device)
    for step, (data, other) in enumerate(loops, start=1):
        writer.write("step", step=step, step_s=0.3, data_wait_s=data, other_s=other)
    writer.close()


@pytest.mark.parametrize("seed", range(5))
def test_each_ranks_steady_median_then_the_median_over_ranks(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    ranks = rng.choice([1, 2, 3, 4])
    expected_per_rank = []
    for rank in range(ranks):
        steady = [(rng.uniform(0, 2e-3), rng.uniform(2e-3, 9e-3)) for _ in range(rng.randint(3, 12))]
        warmup = [(0.5, 2.0), (0.0, 1.0)]  # a first batch's workers starting, a compile: left out
        _write_steps(tmp_path, rank, [*warmup, *steady])
        totals = sorted(d + o for d, o in steady)
        n = len(totals)
        expected_per_rank.append((totals[(n - 1) // 2] + totals[n // 2]) / 2)
    expected_per_rank.sort()
    k = len(expected_per_rank)
    expected = (expected_per_rank[(k - 1) // 2] + expected_per_rank[k // 2]) / 2
    assert calibration_from_telemetry(tmp_path).loop_overhead_us == pytest.approx(expected * 1e6)


def test_a_short_run_keeps_its_first_steps_and_records_without_either_figure_are_skipped(tmp_path: Path) -> None:
    _write_steps(tmp_path, 0, [(0.001, 0.004), (None, None), (None, 0.006), (0.002, None)])
    assert calibration_from_telemetry(tmp_path).loop_overhead_us == pytest.approx(5000.0)  # of 5, 6, 2 ms
    assert loop_overhead_us({}) is None
    assert calibration_from_telemetry(tmp_path / "none").loop_overhead_us is None


def test_gpu_ranks_steps_are_left_out_their_host_runs_ahead_of_the_kernels(tmp_path: Path) -> None:
    """On a GPU the phases are host-clock times of launches: a step's wait for its kernels lands wherever the host
    first syncs (a logged loss between the phases), so the gap between phases is not the loop's own time there."""
    _write_steps(tmp_path, 0, [(0.0, 0.05)] * 6, device="cuda:0")
    _write_steps(tmp_path, 1, [(0.0, 0.06)] * 6, device="cuda:1")
    assert calibration_from_telemetry(tmp_path).loop_overhead_us is None
    _write_steps(tmp_path, 2, [(0.001, 0.002)] * 6)
    assert calibration_from_telemetry(tmp_path).loop_overhead_us == pytest.approx(3000.0)


def test_every_layout_pays_the_measured_loop_once_per_step() -> None:
    shape = model_shape(model("gpt-nano"))
    work = Workload(global_batch_size=64, micro_batch_size=8, seq_len=128, precision="fp32")
    wide = dataclasses.replace(CPU, devices_per_node=8)
    layouts = candidate_layouts(shape, wide, work)
    assert {layout.strategy for layout in layouts} >= {"ddp", "fsdp", "deepspeed", "megatron"}
    measured = dataclasses.replace(wide, loop_overhead_us=7000.0)
    for layout in layouts:
        before = plan_layout(shape, layout, work, wide).estimate
        after = plan_layout(shape, layout, work, measured).estimate
        assert (before.loop_s, after.loop_s) == (0.0, pytest.approx(7e-3))
        assert after.step_time_s - before.step_time_s == pytest.approx(7e-3), layout.label()
        assert after.tokens_per_s == pytest.approx(work.tokens_per_step / after.step_time_s)


def test_the_calibrated_figure_replaces_the_profiles_and_a_negative_one_is_refused(tmp_path: Path) -> None:
    _write_steps(tmp_path, 0, [(0.001, 0.004)] * 6)
    profile = calibrated_profile(CPU, calibration_from_telemetry(tmp_path), "fp32")
    assert (profile.hw.loop_overhead_us, profile.sources["loop_overhead_us"]) == (pytest.approx(5000.0), "measured")
    with pytest.raises(ConfigError, match=r"hw.loop_overhead_us: must be >= 0"):
        validate_profile(dataclasses.replace(CPU, loop_overhead_us=-1.0))
