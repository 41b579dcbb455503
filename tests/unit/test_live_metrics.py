"""The mid-run figures for the user's logger (diagnostics.analysis.live): pure arithmetic over plain numbers."""

from __future__ import annotations

import pytest

from diagnostics.analysis.live import (
    FindingsSeen,
    RanksWindow,
    live_findings,
    ranks_metrics,
    step_metrics,
    window_rate_metrics,
)
from diagnostics.mfu import flops_utilization


def window(step: int, compute: list[float], data: list[float], comm: list[float], step_s: float = 0.1) -> RanksWindow:
    return RanksWindow(step, [step_s] * len(compute), compute, data, comm)


def test_window_rate_gives_tokens_per_device_and_each_utilization_its_peak() -> None:
    out = window_rate_metrics(1000.0, 0.5, 2, 6e6, 8e6, peak_flops=None, calibrated_flops=1e11)
    assert out["throughput/tokens_per_s"] == 2000.0
    assert out["throughput/tokens_per_s_per_device"] == 1000.0
    assert out["throughput/mfu_calibrated"] == pytest.approx(flops_utilization(2000.0, 6e6, 2, 1e11))
    assert out["throughput/hfu_calibrated"] == pytest.approx(2000.0 * 8e6 / (2 * 1e11))
    assert "throughput/mfu" not in out  # no datasheet peak on hw=cpu: no number rather than a made-up one
    # An impossible utilization (>100%: a wrong peak) is left out, not logged.
    assert "throughput/mfu" not in window_rate_metrics(1e9, 1.0, 1, 6e6, 6e6, peak_flops=1e12, calibrated_flops=None)
    assert window_rate_metrics(0.0, 0.0, 2, 6e6, 6e6, None, None) == {}


def test_step_metrics_are_the_windows_median_max_and_shares() -> None:
    out = step_metrics([0.1, 0.3, 0.2], [0.01, 0.03, 0.02], [0.05, 0.15, 0.1])
    assert out["time/step_p50_s"] == pytest.approx(0.2)
    assert out["time/step_max_s"] == pytest.approx(0.3)
    assert out["time/data_wait_share"] == pytest.approx(0.1)
    assert out["time/compute_share"] == pytest.approx(0.5)
    assert step_metrics([], [], []) == {}


def test_ranks_metrics_charge_the_transfer_to_every_rank_and_the_rest_to_waiting() -> None:
    # Rank 1 computes 30 ms longer; rank 0 waits for it at the all-reduce (40 ms), rank 1 only pays the transfer.
    w = window(10, compute=[0.05, 0.08], data=[0.001, 0.001], comm=[0.04, 0.01])
    out = ranks_metrics(w)
    assert out["comm/exposed_share"] == pytest.approx(0.1)  # the smaller wait: what every rank pays
    assert out["comm/waiting_share"] == pytest.approx(0.25 - 0.1)
    assert out["ranks/slowest_rank"] == 1.0  # the busy rank, not the one that waits longest
    assert out["ranks/busy_gap_s"] == pytest.approx(0.03)
    assert out["ranks/busy_gap_share"] == pytest.approx(0.3)
    assert out["ranks/step_time_gap_s"] == pytest.approx(0.0)


def test_a_straggler_is_found_only_when_two_gathers_agree_and_shown_once() -> None:
    slow = window(10, compute=[0.05, 0.08], data=[0.001, 0.001], comm=[0.04, 0.01])
    even = window(10, compute=[0.05, 0.051], data=[0.001, 0.001], comm=[0.01, 0.01])
    assert live_findings(None, slow) == []  # one window is not enough
    assert live_findings(even, slow) == []  # nor is one slow window after an even one
    (finding,) = live_findings(slow, window(20, compute=[0.05, 0.08], data=[0.001, 0.001], comm=[0.04, 0.01]))
    assert (finding.kind, finding.ranks, finding.step, finding.severity) == ("straggler", [1], 20, "critical")
    assert finding.cost == pytest.approx(0.3)
    assert "rank 1" in finding.line() and finding.line().startswith("step 20: critical straggler")
    seen = FindingsSeen()
    assert seen.new([finding]) == [finding]
    assert seen.new([finding]) == []  # the console shows it once


def test_input_bound_needs_a_visible_wait_and_a_warning_becomes_critical_once() -> None:
    def fed(step: int, wait: float) -> RanksWindow:
        return window(step, compute=[0.05, 0.05], data=[wait, wait], comm=[0.005, 0.005])

    assert live_findings(fed(10, 0.002), fed(20, 0.002)) == []  # 2% of the step: within the noise
    (warning,) = live_findings(fed(10, 0.01), fed(20, 0.01))
    assert (warning.kind, warning.severity, warning.ranks) == ("input_bound", "warning", [0, 1])
    (critical,) = live_findings(fed(20, 0.04), fed(30, 0.04))
    seen = FindingsSeen()
    assert seen.new([warning]) == [warning]
    assert seen.new([warning]) == []
    assert seen.new([critical]) == [critical]  # worse than what was shown: shown again
    assert seen.new([warning, critical]) == []


def test_gpu_figures_per_node_are_means_over_its_devices_with_the_least_busy_one() -> None:
    from diagnostics.analysis.live import node_device_metrics

    nan = float("nan")
    devices = [
        {"util_pct": 90.0, "power_w": 600.0, "sm_clock_mhz": 1980.0, "temp_c": 60.0},
        {"util_pct": 30.0, "power_w": 300.0, "sm_clock_mhz": 1980.0, "temp_c": 50.0},
        {"util_pct": 80.0, "power_w": 500.0, "sm_clock_mhz": 1800.0, "temp_c": 70.0},
        {"util_pct": nan, "power_w": nan, "sm_clock_mhz": nan, "temp_c": nan},  # no reading yet
    ]
    w = RanksWindow(10, [0.1] * 4, [0.05] * 4, [0.0] * 4, [0.0] * 4, node=[0, 0, 1, 1], device=devices)
    got = node_device_metrics(w)
    assert got["gpu/node0/util_pct"] == pytest.approx(60.0) and got["gpu/node0/min_util_pct"] == 30.0
    assert got["gpu/node0/power_w"] == pytest.approx(450.0) and got["gpu/node0/temp_c"] == pytest.approx(55.0)
    assert got["gpu/node1/util_pct"] == 80.0 and got["gpu/node1/sm_clock_mhz"] == 1800.0  # the NaN rank left out
    cpu = RanksWindow(10, [0.1] * 2, [0.05] * 2, [0.0] * 2, [0.0] * 2, node=[0, 0], device=[devices[3]] * 2)
    assert node_device_metrics(cpu) == {} and node_device_metrics(window(1, [0.1], [0.0], [0.0])) == {}
