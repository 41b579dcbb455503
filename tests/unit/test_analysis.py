"""Each detector fires on its synthetic run with the right ranks and evidence, and stays silent when healthy."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from diagnostics.analysis import Finding, load_run
from diagnostics.analysis.finding import severity_of
from diagnostics.analysis.thresholds import COST_CRITICAL, COST_WARNING
from diagnostics.diagnosis import analyse
from diagnostics.kinds.input_bound import INPUT_BOUND_FRACTION
from diagnostics.kinds.throttling import slowdown_reasons
from diagnostics.telemetry import TelemetryWriter, telemetry_path
from tests.diag_fixtures import SCENARIOS, T0, _timeline, write_run


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
        ("comm_saturated", "comm_bound", [0, 1], "critical"),
        ("host_overhead", "host_overhead", [0, 1], "critical"),
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
    assert evidence["data_wait_fraction"][0] == pytest.approx(0.30 / (0.30 + 0.343), rel=0.05)
    assert evidence["threshold_fraction"] == INPUT_BOUND_FRACTION
    # data wait w of a step of w + 0.343 s: fraction f needs w = f * 0.343 / (1 - f)
    for fraction, expected in ((0.03, None), (0.10, "warning"), (0.40, "critical")):
        wait = fraction * 0.343 / (1 - fraction)
        found = findings_of(tmp_path / f"f{fraction}", "input_bound", data_wait=wait)
        finding = found.get("input_bound")
        assert (finding.severity if finding else None) == expected, fraction
        if finding:
            assert finding.cost["fraction"] == pytest.approx(fraction, abs=0.01)
            assert "data wait" in finding.cost["basis"]


def test_one_cost_scale_for_every_kind() -> None:
    assert severity_of(COST_WARNING - 1e-9) == "info"
    assert severity_of(COST_WARNING) == "warning"
    assert severity_of(COST_CRITICAL - 1e-9) == "warning"
    assert severity_of(COST_CRITICAL) == "critical"
    assert severity_of(0.9, corroborated=False) == "info"  # one source alone is never more than info


def test_straggler_is_found_by_order_of_arrival_and_costs_what_the_others_wait(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "s", "straggler")
    finding = {f.kind: f for f in analyse(run_dir).findings}["straggler"]
    evidence = finding.evidence
    assert evidence["source"].startswith("order of arrival")
    # Rank 2 computes 1.6x: it falls behind by 0.6 x (forward + backward + optimizer) = 0.192 s per step, most of
    # it in backward; the others never fall behind (they wait for it at the all-reduce).
    assert evidence["falls_behind_s_per_step"][2] == pytest.approx(0.6 * 0.32, rel=0.1)
    assert evidence["slow_phase"] == "backward" and "rank 2 on node0 is slow in backward" in finding.message
    assert "ranks 0,1,3 wait for it" in finding.message
    for rank in (0, 1, 3):
        assert all(v < 0.005 for v in evidence["lateness_growth_s_per_step"][rank].values())
    assert finding.cost["fraction"] == pytest.approx(0.192 / evidence["step_s"], rel=0.1)
    assert finding.severity == "critical"


@pytest.mark.parametrize("phase", ["data", "forward", "backward", "optimizer", "other"])
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("grad_hook", [True, False])
def test_a_slow_rank_is_named_with_its_phase_never_the_rank_that_waits(
    tmp_path: Path, phase: str, rank: int, grad_hook: bool
) -> None:
    """grad_hook=False: the wait at the end of backward is timed as backward compute (older FSDP collectors)."""
    if phase == "backward" and not grad_hook:
        pytest.skip(
            "without timed collectives slowness and wait in one phase end together: no order of arrival to see "
            "(with them: test_under_fsdp_the_rank_that_waits_inside_the_phase_is_told_apart_by_its_timed_collectives)"
        )
    found = findings_of(tmp_path, "healthy", slow_rank=rank, slow_phase=phase, slow_s=0.06, grad_hook=grad_hook)
    kind = "input_bound" if phase == "data" else "straggler"
    assert kind in found, found
    finding = found[kind]
    assert finding.ranks == [rank] and finding.evidence["slow_phase"] == phase
    assert finding.severity == "warning" and finding.cost["fraction"] == pytest.approx(0.06 / 0.403, rel=0.1)
    assert not [f for f in found.values() if f.severity != "info" and f.ranks == [1 - rank]]
    assert ({"input_bound", "straggler"} - {kind}).isdisjoint(found)  # one cause, one finding


@pytest.mark.parametrize("phase", ["forward", "backward"])
@pytest.mark.parametrize("rank", [0, 1])
def test_under_fsdp_the_rank_that_waits_inside_the_phase_is_told_apart_by_its_timed_collectives(
    tmp_path: Path, phase: str, rank: int
) -> None:
    """FSDP2: the ranks meet at an all-gather inside forward and inside backward, so the waiting rank ends the
    phase together with the slow one. Its time inside the collectives (forward_comm_s, backward_comm_s) is what
    it waited: the phase's own work is what is left, and only the slow rank fell behind in it."""
    found = findings_of(
        tmp_path, "healthy", slow_rank=rank, slow_phase=phase, slow_s=0.06, sync_in_phases=True, grad_hook=False
    )
    finding = found["straggler"]
    assert finding.ranks == [rank] and finding.evidence["slow_phase"] == phase, finding.message
    assert finding.severity == "warning" and finding.cost["fraction"] == pytest.approx(0.06 / 0.408, rel=0.1)
    growth = finding.evidence["lateness_growth_s_per_step"]
    assert growth[rank][phase] == pytest.approx(0.06, rel=0.15)  # the slow rank falls behind in its own work
    assert growth[rank][f"{phase}_comm"] < -0.05  # ... and is caught up with inside the collective
    assert max(growth[1 - rank].values()) < 0.005  # the waiting rank never falls behind
    assert not [f for f in found.values() if f.severity != "info" and f.ranks == [1 - rank]]


@pytest.mark.parametrize("rank", [0, 1])
def test_under_zero3_a_rank_slow_in_its_optimizer_step_is_told_apart_from_the_one_waiting_in_it(
    tmp_path: Path, rank: int
) -> None:
    """ZeRO-3's optimizer step gathers and reduces: the fast rank waits for the slow one inside its own optimizer
    step, and both end it together. Its time inside those collectives (optimizer_comm_s) is the wait."""
    found = findings_of(
        tmp_path, "healthy", slow_rank=rank, slow_phase="optimizer", slow_s=0.06, sync_in_phases=True,
        sync_in_optimizer=True, grad_hook=False,
    )  # fmt: skip
    finding = found["straggler"]
    assert finding.ranks == [rank] and finding.evidence["slow_phase"] == "optimizer", finding.message
    growth = finding.evidence["lateness_growth_s_per_step"]
    assert growth[rank]["optimizer"] == pytest.approx(0.06, rel=0.15)
    assert growth[rank]["optimizer_comm"] < -0.05  # caught up with inside the step's collectives
    assert max(growth[1 - rank].values()) < 0.005
    assert finding.cost["fraction"] == pytest.approx(0.06 / (0.408 + 0.06), rel=0.15)
    assert not [f for f in found.values() if f.severity != "info" and f.ranks == [1 - rank]]


def test_under_fsdp_without_timed_collectives_the_waiting_rank_is_still_never_blamed(tmp_path: Path) -> None:
    """Older collectors: the wait inside forward cannot be told from work; nothing is named rather than the wrong
    rank."""
    found = findings_of(
        tmp_path, "healthy", slow_rank=0, slow_phase="forward", slow_s=0.06, sync_in_phases=True,
        grad_hook=False, timed_collectives=False,
    )  # fmt: skip
    assert not [f for f in found.values() if f.severity != "info" and f.ranks == [1]], found


def test_a_stragglers_cost_is_what_the_run_gains_without_it(tmp_path: Path) -> None:
    """Every 4th step rank 0 is held between steps (a log write) as long as rank 1's slow forward: in those steps
    the slow rank costs nothing (the job waits for rank 0 anyway), and beyond the others it even reads -0.12 s
    (rank 0 fell behind, rank 1 did not). The cost is what the run's time would gain: 0.12 s in 3 of 4 steps of
    0.463 s; the mean excess over the 18 steady steps reads (13 - 5) / 18 of 0.12 s."""
    found = findings_of(tmp_path, "healthy", slow_rank=1, slow_phase="forward", slow_s=0.12, rank0_hold=(4, 0.12))
    finding = found["straggler"]
    assert finding.ranks == [1] and finding.evidence["slow_phase"] == "forward"
    assert finding.evidence["falls_behind_s_per_step"][1] == pytest.approx(8 / 18 * 0.12, rel=0.1)
    assert finding.cost["fraction"] == pytest.approx(0.75 * 0.12 / (0.343 + 0.12), rel=0.05)
    assert "mean step time" in finding.cost["basis"]


def test_a_rank_waiting_for_slow_batches_inside_its_forward_is_not_a_straggler(tmp_path: Path) -> None:
    """The reported case: rank 1's batches are slow; rank 0 waits for it in the collective before forward (DDP's
    buffer broadcast, FSDP's all-gather), so rank 0's local compute is the longer one."""
    run_dir = write_run(tmp_path / "d", "healthy", slow_rank=1, slow_phase="data", slow_s=0.1, sync_before_forward=True)
    analysis = analyse(run_dir)
    assert analysis.phases[0].local_compute_s > analysis.phases[1].local_compute_s + 0.09  # what fooled the old signal
    assert [(f.kind, f.ranks) for f in analysis.findings] == [("input_bound", [1])]


def test_without_start_times_a_straggler_is_info_at_most(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "s", "straggler")
    for rank in range(4):
        records = [json.loads(line) for line in telemetry_path(run_dir, rank).read_text().splitlines()]
        for rec in records:
            rec.pop("start_t", None)
        telemetry_path(run_dir, rank).write_text("".join(json.dumps(r) + "\n" for r in records))
    finding = {f.kind: f for f in analyse(run_dir).findings}["straggler"]
    assert finding.ranks == [2] and finding.severity == "info"
    assert finding.evidence["corroborated"] is False and "local compute" in finding.evidence["source"]


def test_ranks_that_fall_behind_in_turn_are_not_stragglers(tmp_path: Path) -> None:
    """A loaded shared host: each step the scheduler holds one rank or the other. Both fall behind ~half the
    time by the same amount; the others' wait is real (the verdict's "waiting"), but no rank is the cause."""
    analysis = analyse(write_run(tmp_path / "skew", "healthy", skew=0.08, steps=60))
    assert "straggler" not in {f.kind for f in analysis.findings}
    assert analysis.summary.step_shares["waiting"] > 0.05


def test_mild_imbalance_costs_what_it_costs_and_noise_is_not_a_straggler(tmp_path: Path) -> None:
    """Rank 2 of 4 computes 10% longer: the run gains what the fixture's timeline gains with it at 1.0 (less than
    its 10% of the compute: the job still waits for the noisiest of the other three)."""
    mild = findings_of(tmp_path / "a", "straggler", slow_factor=1.1)["straggler"]
    slow, even = (_timeline(dataclasses.replace(SCENARIOS["straggler"], slow_factor=f), 4) for f in (1.1, 1.0))
    gain = 1.0 - (max(s.start_t + s.step_s for s in even[-1]) - T0) / (max(s.start_t + s.step_s for s in slow[-1]) - T0)
    assert mild.severity == "warning" and mild.cost["fraction"] == pytest.approx(gain, abs=0.01)
    assert "straggler" not in findings_of(tmp_path / "b", "straggler", slow_factor=1.02)


def test_comm_bound_uses_the_minimum_over_ranks(tmp_path: Path) -> None:
    found = findings_of(tmp_path, "comm_bound")
    evidence = found["comm_bound"].evidence
    assert evidence["min_over_ranks"] == min(evidence["exposed_comm_fraction"].values())
    assert evidence["step_comm_wait_fraction"][0] == pytest.approx(0.40 / 0.7258, rel=0.02)
    assert found["low_overlap"].evidence["overlap_over_comm"][0] == pytest.approx(0.05)
    assert "comm_bound" not in findings_of(tmp_path, "low_overlap")  # exposed comm below 25% of the step


def test_on_a_busy_host_comm_bound_stands_for_the_exposed_communication_alone(tmp_path: Path) -> None:
    """low_overlap has no lever where the compute threads fill every core and would cost the same exposed
    communication as comm_bound a second time; with free cores it stays (its lever, overlap, is its own)."""
    busy = analyse(write_run(tmp_path / "busy", "comm_bound", cpu_count=2))
    assert [f.kind for f in busy.findings if f.kind in ("comm_bound", "low_overlap")] == ["comm_bound"]
    free = analyse(write_run(tmp_path / "free", "comm_bound", cpu_count=16))
    assert {"comm_bound", "low_overlap"} <= {f.kind for f in free.findings}


def test_saturated_comm_is_comm_bound_even_when_overlapped(tmp_path: Path) -> None:
    found = findings_of(tmp_path, "comm_saturated")
    assert set(found) == {"comm_bound"}
    evidence = found["comm_bound"].evidence
    assert evidence["min_over_ranks"] < 0.25
    assert evidence["comm_over_backward_compute"][0] == pytest.approx(0.22 / 0.202, rel=0.05)
    assert "no headroom" in found["comm_bound"].message


@pytest.mark.parametrize(("profile_comm", "cpu_count", "bound"), [(0.1, 2, True), (0.08, 2, False), (0.1, 64, False)])
def test_overlapped_comm_on_a_busy_host_costs_all_its_time(
    tmp_path: Path, profile_comm: float, cpu_count: int, bound: bool
) -> None:
    """Half the backward's worth of collectives, mostly overlapped: under saturation's 0.8 and exposed under 25%.
    With free cores that is overlap doing its job; where the compute threads fill every core the overlapped part
    runs on the compute's cores, and from 25% of the step (all of the collectives' time) it is comm_bound, costed on
    all of it. Measured: 4 FSDP ranks on 2 cores at 26% read nothing before; reshard_after_forward=false then gained
    ~11% tokens/s over 7 interleaved pairs (benchmarks/RESULTS.md)."""
    found = findings_of(tmp_path, "comm_saturated", profile_comm=profile_comm, cpu_count=cpu_count)
    assert ("comm_bound" in found) == bound
    if bound:
        evidence = found["comm_bound"].evidence
        assert evidence["min_over_ranks"] < 0.25 and evidence["comm_over_backward_compute"][0] < 0.8
        assert evidence["all_comm_fraction"] >= 0.25
        assert found["comm_bound"].cost_fraction == pytest.approx(evidence["all_comm_fraction"], abs=1e-3)
        assert "on the compute's cores" in found["comm_bound"].message


@pytest.mark.parametrize(
    ("scenario", "changes", "bound"),
    [("comm_bound", {}, True), ("comm_saturated", {}, True), ("comm_saturated", {"overlap": 0.0}, False)],
)
def test_ddp_is_comm_bound_on_what_its_step_records_time(
    tmp_path: Path, scenario: str, changes: dict, bound: bool
) -> None:
    """Under DDP every step times the gradients' exposure (the wait after backward), and the cost is that: 40% exposed
    is comm_bound. A profile window whose exposure agrees with the steps' (9%) stands for the gradients: collectives
    as long as the backward on a busy host are comm_bound by saturation. A window that reads seven times the steps'
    exposure holds collectives that are not the gradients' (a logged metric's sync, the vote): not comm_bound."""
    found = findings_of(tmp_path, scenario, overrides=(), **changes)
    assert ("comm_bound" in found) == bound
    if scenario == "comm_bound":
        evidence = found["comm_bound"].evidence
        assert found["comm_bound"].cost_fraction == pytest.approx(min(evidence["step_comm_wait_fraction"].values()))


def test_one_rank_is_never_comm_bound(tmp_path: Path) -> None:
    """FSDP2 over one GPU profiles its local copies as collectives (13% "comm_bound" on an H200): nothing moves."""
    overrides = (*SCENARIOS["comm_saturated"].overrides, "hw.devices_per_node=1")
    assert "comm_bound" in findings_of(tmp_path / "two", "comm_saturated")
    assert "comm_bound" not in findings_of(tmp_path / "one", "comm_saturated", overrides=overrides)


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
    assert "DataLoader" not in finding.message and "waiting_on_loader" not in finding.evidence


def test_hang_on_a_stuck_loader_worker_says_where_the_worker_is(tmp_path: Path) -> None:
    frame = "worker 4242 at StuckDataset.__getitem__ (my_data.py:31)"
    finding = findings_of(tmp_path, "hang", hang_loader_frames=(frame,))["hang"]
    assert finding.ranks == [1] and finding.evidence["waiting_on_loader"] == {1: [frame]}
    assert f"rank 1 waits for its DataLoader workers ({frame})" in finding.message


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
    found = findings_of(tmp_path, "comm_bound", grad_hook=False, overrides=("strategy=fsdp",))
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


def test_one_profile_window_against_the_whole_run_costs_what_both_agree_on(tmp_path: Path) -> None:
    """The README default run's case: the 3-step window saw 12% communication on rank 1 (its gloo events include
    waiting for rank 0), the whole run's steps 2.5% of truly exposed transfer. The smaller counts, so: info."""
    run_dir = write_run(tmp_path / "w", "low_overlap", comm=0.008, profile_comm=0.05, overlap=0.01)
    path = telemetry_path(run_dir, 1)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for rec in records:
        if rec["kind"] == "profile":
            rec["comm_s"] *= 3  # rank 1 arrived first at each all-reduce of the window and waited for rank 0
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    (finding,) = analyse(run_dir).findings
    evidence = finding.evidence
    assert finding.kind == "low_overlap" and finding.ranks == [0, 1]
    assert evidence["collective_comm_s_per_step"] == pytest.approx(0.05, rel=0.01)  # the minimum over ranks
    assert evidence["exposed_comm_fraction_steps"][0] == pytest.approx(0.008 / 0.36, rel=0.1)
    assert finding.cost["fraction"] == pytest.approx(0.008 / 0.36, abs=0.005)
    assert finding.severity == "info" and "ranks 0,1 hide only 1% of their communication" in finding.message


def test_exposed_comm_that_only_a_few_noisy_steps_push_over_5_percent_is_info(tmp_path: Path) -> None:
    """healthy-ddp of benchmarks/diagnosis_accuracy.py on a loaded host: ~3% exposed all-reduce in most steps, one
    step's collective held 0.8 s by the scheduler. The mean reads over 5%; its lower 95% bound does not."""
    found = findings_of(tmp_path, "low_overlap", comm=0.01, profile_comm=0.08, overlap=0.1, comm_spike=(10, 0.8))
    low = found["low_overlap"]
    assert low.cost["fraction"] >= 0.05  # the estimate stays what the run measured ...
    assert low.evidence["cost_lower_bound"] < 0.05 and low.severity == "info"  # ... but it is not a warning
    steady = findings_of(tmp_path / "steady", "low_overlap")  # the same exposed share in every step
    assert steady["low_overlap"].severity == "warning"
    assert steady["low_overlap"].evidence["cost_lower_bound"] >= 0.05


def test_exposed_comm_is_the_last_arrivals_wait_not_the_mean(tmp_path: Path) -> None:
    """Ranks that arrive first at the all-reduce wait for the last: per step only the minimum is transfer."""
    found = findings_of(tmp_path, "straggler", comm=0.02, profile_comm=0.03, overlap=0.05)
    assert set(found) == {"straggler", "low_overlap"}
    low = found["low_overlap"]
    # The other ranks' mean comm wait is ~0.2 s (they wait for rank 2); the transfer is 0.02 s of a 0.54 s step.
    assert low.evidence["exposed_comm_fraction_steps"][0] == pytest.approx(0.02 / 0.54, rel=0.1)
    assert low.cost["fraction"] < found["straggler"].cost["fraction"]
    assert found["straggler"].severity == "critical" and low.severity == "info"


def test_a_profile_window_alone_is_info_at_most(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "one", "host_overhead")
    telemetry_path(run_dir, 1).write_text(
        "".join(line + "\n" for line in telemetry_path(run_dir, 1).read_text().splitlines() if '"profile"' not in line)
    )
    finding = {f.kind: f for f in analyse(run_dir).findings}["host_overhead"]
    assert finding.severity == "info" and finding.evidence["corroborated"] is False
    assert finding.cost["fraction"] > 0.25  # the estimate is kept; only the grade is capped


def test_findings_are_ordered_by_cost(tmp_path: Path) -> None:
    # ~20% of every step waiting for data against a low_overlap of a few percent: the bigger lever comes first.
    found = analyse(write_run(tmp_path / "o", "low_overlap", data_wait=0.09, comm=0.03)).findings
    assert [f.kind for f in found] == ["input_bound", "low_overlap"]
    assert found[0].cost["fraction"] > found[1].cost["fraction"]
    assert found[0].severity == "warning"


def test_low_mfu_against_a_calibrated_peak_is_a_hint_without_a_cost(tmp_path: Path) -> None:
    cpu = findings_of(tmp_path / "cpu", "healthy", mfu=0.05)["low_mfu"]
    assert cpu.severity == "info" and cpu.cost["fraction"] == 0.0 and "not estimated" in cpu.cost["basis"]
    gpu = findings_of(tmp_path / "gpu", "low_mfu")["low_mfu"]  # 5% of a datasheet peak: 75% would go at 20%
    assert gpu.severity == "critical" and gpu.cost["fraction"] == pytest.approx(0.75, abs=0.01)


def _pipeline_steps(steps: int, slow_rank: int | None, where: str, slow_s: float) -> list[list[dict]]:
    """Per rank, the step records of a 2-stage pipeline on one clock: the stages meet at the start of the schedule
    (the last stage needs the first one's activations), each computes 0.2 s inside a 0.3 s schedule (its bubble),
    the first stage ends its schedule 0.02 s after the last one (its final backward), then each steps its own
    optimizer (0.01 s; ``where="optimizer"`` adds ``slow_s`` on ``slow_rank``) or computes longer inside the
    schedule (``where="schedule"``: the other stage idles longer)."""
    start, records = [T0_PIPE, T0_PIPE], [[], []]
    for step in range(1, steps + 1):
        ready = [start[r] + 0.001 + 0.002 for r in (0, 1)]  # other, data
        begin = max(ready)
        extra = [slow_s if r == slow_rank and where == "schedule" else 0.0 for r in (0, 1)]
        schedule_end = begin + 0.3 + max(extra)
        for r in (0, 1):
            ends = schedule_end + (0.02 if r == 0 else 0.0)
            compute = 0.2 + extra[r]
            optimizer = 0.01 + (slow_s if r == slow_rank and where == "optimizer" else 0.0)
            end = ends + optimizer
            step_s = end - start[r]
            wall = ends - ready[r]
            records[r].append({"kind": "step", "step": step, "t": end, "step_s": step_s, "start_t": start[r],
                               "data_wait_s": 0.002, "forward_s": compute / 3, "backward_s": 2 * compute / 3,
                               "optimizer_s": optimizer, "bubble_fraction": (wall - compute) / step_s,
                               "tokens": 8192})  # fmt: skip
            start[r] = end
    return records


T0_PIPE = 1_700_000_000.0


@pytest.mark.parametrize("slow_rank", [0, 1])
def test_a_pipeline_stage_slow_outside_its_schedule_is_the_straggler_and_its_wait_is_not_bubble(
    tmp_path: Path, slow_rank: int
) -> None:
    run_dir = write_run(tmp_path / "pp", "bubble_megatron", steps=30)
    for rank, steps in enumerate(_pipeline_steps(30, slow_rank, "optimizer", 0.15)):
        path = telemetry_path(run_dir, rank)
        kept = [json.loads(line) for line in path.read_text().splitlines()]
        kept = [r for r in kept if r["kind"] != "step"]
        path.write_text("".join(json.dumps(r) + "\n" for r in [*kept, *steps]))
    found = {f.kind: f for f in analyse(run_dir).findings}
    straggler = found["straggler"]
    assert straggler.ranks == [slow_rank] and straggler.evidence["slow_phase"] == "optimizer"
    assert straggler.severity == "critical" and straggler.cost["fraction"] == pytest.approx(0.15 / 0.48, abs=0.03)
    # The bubble is what every stage idles (0.1-0.12 s of the 0.48 s step), not the waiting stage's 0.15 s on top.
    bubble = found["pipeline_bubble"]
    assert bubble.cost["fraction"] == pytest.approx(0.11 / 0.48, abs=0.03)
    assert max(bubble.evidence["bubble_fraction"].values()) >= 0.25 / 0.48


def test_pipeline_stages_that_differ_only_inside_the_schedule_raise_no_straggler(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "pp", "bubble_megatron", steps=30)
    for rank, steps in enumerate(_pipeline_steps(30, 1, "schedule", 0.1)):
        path = telemetry_path(run_dir, rank)
        kept = [r for line in path.read_text().splitlines() if (r := json.loads(line))["kind"] != "step"]
        path.write_text("".join(json.dumps(r) + "\n" for r in [*kept, *steps]))
    found = {f.kind: f for f in analyse(run_dir).findings}
    assert "straggler" not in found and "pipeline_bubble" in found
    assert "waiting for rank 1" in found["pipeline_bubble"].message  # the busier stage: the rest is imbalance


def test_a_rank_held_inside_its_phase_by_a_rank_already_later_is_not_blamed_for_it() -> None:
    """Gloo's broadcast tree on 4 ranks: rank 1 relays DDP's buffer broadcast to rank 3, late from its optimizer, and
    waits inside its forward while ranks 0 and 2 go on. Lateness (ms) at each segment boundary of one step."""
    from diagnostics.kinds.straggler import SEGMENTS, _growth

    n = len(SEGMENTS) + 1
    forward = [name for _, name in SEGMENTS].index("forward")

    def path(start: float, *steps: tuple[int, float]) -> list[float]:
        out = [start] * n
        for segment, value in steps:
            out[segment + 1 :] = [value] * (n - segment - 1)
        return out

    late = {0: path(0.0), 2: path(0.0), 3: path(70.0, (forward, 75.0))}
    held = {**late, 1: path(10.0, (forward, 78.0))}
    assert _growth(held, 1)[forward] == pytest.approx(8.0)  # only what it lost beyond rank 3's lateness
    own = {0: path(0.0), 2: path(0.0), 3: path(0.0), 1: path(0.0, (forward, 60.0))}
    assert _growth(own, 1)[forward] == pytest.approx(60.0)  # nobody was later: all of it is its own
    assert _growth(held, 3)[forward] == pytest.approx(5.0)  # the late rank's own lag in forward still counts


@pytest.mark.parametrize(("second_s", "named"), [(0.04, [2]), (0.15, [1, 2])])
def test_a_second_rank_is_named_only_when_it_lags_comparably(tmp_path: Path, second_s: float, named: list[int]) -> None:
    """Rank 2 lags 0.3 s a step in forward; rank 1 lags ``second_s`` in its optimizer every step (either above the
    straggler's 5% of the step): an eighth of it is what relaying a collective or a shared host's scheduling leaves
    behind, half of it is a second slow rank."""
    found = findings_of(
        tmp_path,
        "healthy",
        overrides=("hw.devices_per_node=4",),
        slow_rank=2,
        slow_phase="forward",
        slow_s=0.3,
        stall=(1, 1, "optimizer", second_s),
    )
    straggler = found["straggler"]
    assert straggler.ranks == named and straggler.evidence["slow_phase"] == "forward"
    assert set(straggler.evidence["falls_behind_s_per_step"]) == set(named)
    if named == [2]:
        assert "ranks 0,1,3 wait for it" in straggler.message
