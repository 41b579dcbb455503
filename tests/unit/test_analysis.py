"""Each detector fires on its synthetic run with the right ranks and evidence, and stays silent when healthy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diagnostics.analysis import Finding, analyse, load_run
from diagnostics.analysis.detect_devices import slowdown_reasons
from diagnostics.analysis.finding import grade
from diagnostics.analysis.thresholds import INPUT_BOUND_CRITICAL_FRACTION, INPUT_BOUND_FRACTION
from diagnostics.telemetry import TelemetryWriter, telemetry_path
from tests.diag_fixtures import write_run


def findings_of(tmp_path: Path, scenario: str, **changes: object) -> dict[str, Finding]:
    found = analyse(write_run(tmp_path / scenario, scenario, **changes)).findings
    by_kind = {f.kind: f for f in found}
    assert len(by_kind) == len(found), "one finding per kind"
    return by_kind


def test_healthy_run_has_no_findings_at_all(tmp_path: Path) -> None:
    analysis = analyse(write_run(tmp_path / "ok", "healthy"))
    assert analysis.findings == []
    assert analysis.run.problems == []
    s = analysis.summary
    assert s.tokens_per_s and s.calibrated_mfu == pytest.approx(0.35) and s.mfu is None  # CPU: no datasheet peak
    assert s.step_time["p50"] <= s.step_time["p90"] <= s.step_time["p99"]
    assert s.step_time["steps"] == 18  # 20 steps minus the 2 warm-up steps
    assert s.peak_memory["peak_rss_bytes"] == pytest.approx(1.5 * 1024**3)
    assert [p.rank for p in analysis.phases] == [0, 1]


@pytest.mark.parametrize(
    ("scenario", "kind", "ranks", "severity"),
    [
        ("input_bound", "input_bound", [0, 1], "critical"),
        ("straggler", "straggler", [2], "critical"),
        ("comm_bound", "comm_bound", [0, 1], "critical"),
        ("low_overlap", "low_overlap", [0, 1], "warning"),
        ("comm_saturated", "comm_bound", [0, 1], "warning"),
        ("host_overhead", "host_overhead", [0, 1], "warning"),
        ("throttled", "throttling", [1], "critical"),
        ("memory_pressure", "memory_pressure", [0, 1], "critical"),
        ("memory_pressure_fsdp", "memory_pressure", [0, 1], "warning"),
        ("low_mfu", "low_mfu", [0, 1], "critical"),
        ("bubble", "pipeline_bubble", [0, 1], "critical"),
        ("bubble_megatron", "pipeline_bubble", [0, 1], "critical"),
        ("hang", "hang", [1], "critical"),
    ],
)
def test_detector_fires_on_its_scenario(tmp_path: Path, scenario: str, kind: str, ranks: list, severity: str) -> None:
    found = findings_of(tmp_path, scenario)
    assert kind in found, found
    finding = found[kind]
    assert finding.ranks == ranks
    assert finding.severity == severity
    assert finding.message and "\n" not in finding.message
    assert finding.evidence
    json.dumps(finding.to_json())  # evidence is plain data
    # No false alarm: the stories that are not this scenario's stay quiet.
    assert "input_bound" not in found or scenario == "input_bound"
    assert "straggler" not in found or scenario == "straggler"


def test_input_bound_evidence_and_severity_thresholds(tmp_path: Path) -> None:
    evidence = findings_of(tmp_path, "input_bound")["input_bound"].evidence
    assert evidence["data_wait_fraction"][0] == pytest.approx(0.30 / (0.30 + 0.322 + 0.02), rel=0.05)
    assert evidence["threshold_fraction"] == INPUT_BOUND_FRACTION
    # data wait w of a step of w + 0.342 s: fraction f needs w = f * 0.342 / (1 - f)
    for fraction, expected in ((0.05, None), (0.15, "warning"), (0.40, "critical")):
        wait = fraction * 0.342 / (1 - fraction)
        found = findings_of(tmp_path / f"f{fraction}", "input_bound", data_wait=wait)
        assert (found["input_bound"].severity if "input_bound" in found else None) == expected, fraction


def test_grade_boundaries() -> None:
    assert grade(INPUT_BOUND_FRACTION - 1e-9, INPUT_BOUND_FRACTION, INPUT_BOUND_CRITICAL_FRACTION) is None
    assert grade(INPUT_BOUND_FRACTION, INPUT_BOUND_FRACTION, INPUT_BOUND_CRITICAL_FRACTION) == "warning"
    assert grade(INPUT_BOUND_CRITICAL_FRACTION, INPUT_BOUND_FRACTION, INPUT_BOUND_CRITICAL_FRACTION) == "critical"
    assert grade(0.05, 0.2, 0.1, below=True) == "critical"
    assert grade(0.15, 0.2, 0.1, below=True) == "warning"
    assert grade(0.25, 0.2, 0.1, below=True) is None


def test_straggler_comes_from_local_compute_not_equalized_step_time(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "s", "straggler")
    run = load_run(run_dir)
    # DDP-like: every rank reports the same step time, so step_s alone cannot show the straggler.
    assert len({round(s.step_s, 9) for tele in run.ranks.values() for s in tele.steps if s.step == 10}) == 1
    finding = {f.kind: f for f in analyse(run_dir).findings}["straggler"]
    assert finding.evidence["source"] == "ranks all-gather"
    assert finding.evidence["ratio_to_median_of_others"][2] == pytest.approx(1.6, rel=0.05)
    assert finding.evidence["slow_windows"][2] == finding.evidence["windows"] == 4
    assert finding.evidence["comm_wait_s"][0] > finding.evidence["comm_wait_s"][2]  # the others wait for rank 2
    assert "rank 2" in finding.message and "node0" in finding.message


def test_straggler_without_all_gather_uses_each_ranks_step_records(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "s", "straggler")
    lines = telemetry_path(run_dir, 0).read_text().splitlines()
    telemetry_path(run_dir, 0).write_text("\n".join(x for x in lines if '"kind": "ranks"' not in x) + "\n")
    finding = {f.kind: f for f in analyse(run_dir).findings}["straggler"]
    assert finding.ranks == [2] and finding.evidence["source"] == "per-rank step records"


def test_mild_imbalance_is_not_a_straggler(tmp_path: Path) -> None:
    assert "straggler" not in findings_of(tmp_path, "straggler", slow_factor=1.1)


def test_comm_bound_uses_the_minimum_over_ranks(tmp_path: Path) -> None:
    found = findings_of(tmp_path, "comm_bound")
    evidence = found["comm_bound"].evidence
    assert evidence["min_over_ranks"] == min(evidence["exposed_comm_fraction"].values())
    assert evidence["step_comm_wait_fraction"][0] == pytest.approx(0.40 / 0.7258, rel=0.02)
    assert found["low_overlap"].evidence["overlap_over_comm"][0] == pytest.approx(0.05)
    assert "comm_bound" not in findings_of(tmp_path, "low_overlap")  # exposed comm below 25% of the step


def test_saturated_comm_is_comm_bound_even_when_overlapped(tmp_path: Path) -> None:
    found = findings_of(tmp_path, "comm_saturated")
    assert set(found) == {"comm_bound"}
    evidence = found["comm_bound"].evidence
    assert evidence["min_over_ranks"] < 0.25
    assert evidence["comm_over_backward_compute"][0] == pytest.approx(0.22 / 0.202, rel=0.05)
    assert "no headroom" in found["comm_bound"].message


def test_torn_last_line_and_missing_rank_are_tolerated(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "torn", "input_bound")
    with telemetry_path(run_dir, 1).open("a") as handle:
        handle.write('{"kind": "step", "rank": 1, "step": 21, "step_s": 0.6')  # killed mid-write
    run = load_run(run_dir)
    assert any("rank0001.jsonl" in p and "torn" in p for p in run.problems)
    assert [f.kind for f in analyse(run_dir).findings] == ["input_bound"]
    telemetry_path(run_dir, 1).unlink()
    analysis = analyse(run_dir)
    assert any("rank(s) [1]" in p for p in analysis.run.problems)
    assert analysis.findings[0].ranks == [0]


def test_bad_values_and_unknown_fields_are_ignored(tmp_path: Path) -> None:
    run_dir = tmp_path / "odd"
    writer = TelemetryWriter(run_dir, 0)
    for step in range(1, 8):
        writer.write("step", step=step, step_s="slow", data_wait_s=None, new_field=[1, 2])
    writer.write("step", step="seven", step_s=1.0)
    writer.write("sample", source="cpu", cpu_util_pct=float("nan"), rss_bytes=True)
    writer.close()
    analysis = analyse(run_dir)
    assert analysis.findings == []
    assert analysis.summary.step_time["p50"] is None
    assert analysis.run.ranks[0].samples[0].cpu_util_pct is None and analysis.run.ranks[0].samples[0].rss_bytes is None
    assert any("run.json" in p for p in analysis.run.problems)


def test_no_telemetry_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no telemetry"):
        load_run(tmp_path)


def test_mfu_above_100_percent_is_reported_as_accounting_error(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "gpu", "low_mfu")
    writer = TelemetryWriter(run_dir, 0)
    writer.write("throughput", tokens_per_s=1e9, mfu=1.7, hfu=1.7, peak_flops=989.4e12)
    writer.close()
    analysis = analyse(run_dir)
    assert analysis.summary.mfu is None and analysis.summary.hfu is None
    assert any("170.0%" in e for e in analysis.summary.accounting_errors)
    assert "low_mfu" not in {f.kind for f in analysis.findings}


def test_hang_names_the_rank_outside_the_collective(tmp_path: Path) -> None:
    finding = findings_of(tmp_path, "hang")["hang"]
    assert finding.evidence["in_collective"] == {0: True, 1: False}
    assert finding.evidence["last_step"] == {0: 7, 1: 7}
    assert finding.evidence["timeout_s"] == 60 and finding.evidence["stacks_dir"].endswith("hang")
    assert "rank 1 not inside a collective" in finding.message


def test_throttle_reason_formats() -> None:
    assert slowdown_reasons(0x40 | 0x1) == ["hw_thermal_slowdown"]  # GpuIdle is not a slowdown
    assert slowdown_reasons(0x1 | 0x2) == []
    assert slowdown_reasons(["HwThermalSlowdown", "GpuIdle"]) == ["hwthermalslowdown"]
    assert slowdown_reasons({"sw_power_cap": True, "gpu_idle": True}) == ["sw_power_cap"]
    assert slowdown_reasons(None) == []


def test_finding_vocabulary_is_enforced() -> None:
    with pytest.raises(ValueError, match="unknown finding kind"):
        Finding("slow", "warning", [0], {}, "x")
    with pytest.raises(ValueError, match="unknown severity"):
        Finding("hang", "fatal", [0], {}, "x")


def test_fsdp_style_comm_is_found_from_the_profile(tmp_path: Path) -> None:
    # FSDP2's gradients bypass the grad hook: the step timer counts the communication wait as compute.
    found = findings_of(tmp_path, "comm_bound", grad_hook=False)
    assert "comm_bound" in found and "straggler" not in found
    evidence = found["comm_bound"].evidence
    assert evidence["step_comm_wait_fraction"] == {}
    assert evidence["min_over_ranks"] == min(evidence["profile_exposed_comm_fraction"].values())


def test_one_slow_step_is_not_host_overhead(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "ckpt", "healthy")
    for rank in (0, 1):
        path = telemetry_path(run_dir, rank)
        records = [json.loads(line) for line in path.read_text().splitlines()]
        for rec in records:
            if rec["kind"] == "step" and rec["step"] == 15:
                rec["step_s"] += 3.0  # a checkpoint write inside the step, attributed to no phase
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    analysis = analyse(run_dir)
    assert analysis.findings == []
    assert analysis.phases[0].other_s > 0.1 and analysis.phases[0].other_median_s < 0.01


def test_pipeline_waits_are_bubble_not_host_overhead_or_unhidden_comm(tmp_path: Path) -> None:
    """A pipeline stage's wait inside its schedule is explained by the bubble; its p2p sends/receives are not
    data-parallel communication left unhidden."""
    found = findings_of(tmp_path, "bubble_megatron")
    assert set(found) == {"pipeline_bubble"}, found
    assert found["pipeline_bubble"].evidence["bubble_fraction"][0] == pytest.approx(0.35, abs=0.05)


def test_calibrated_peak_is_the_better_of_each_ranks_start_and_end_measurements(tmp_path: Path) -> None:
    """A measurement taken while other processes load the host reads low; the summary keeps the higher one."""
    run_dir = write_run(tmp_path / "ok", "healthy")
    for rank in (0, 1):
        lines = telemetry_path(run_dir, rank).read_text().splitlines()
        records = [json.loads(line) for line in lines]
        (calibration,) = [r for r in records if r["kind"] == "calibration"]
        # The run's throughput record carries no peak: the summary derives it from the calibrations.
        kept = [r for r in records if r["kind"] != "throughput"]
        doubled = {**calibration, "when": "end", "flops_per_s": 2 * calibration["flops_per_s"]}
        telemetry_path(run_dir, rank).write_text("\n".join(json.dumps(r) for r in [*kept, doubled]) + "\n")
    summary = analyse(run_dir).summary
    assert summary.calibrated_peak_flops == pytest.approx(2 * calibration["flops_per_s"])
    assert summary.calibrated_mfu == pytest.approx(0.35 / 2, rel=1e-3)  # tokens/s recomputed from the steps
