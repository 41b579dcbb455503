"""The verdict and table logic of benchmarks/diagnosis_accuracy.py and diagnosis_stability.py (no runs)."""

from __future__ import annotations

import json

import pytest

from benchmarks.diagnosis_accuracy import (
    RunResult,
    Scenario,
    format_table,
    judge,
    load_run,
    median_step,
    targets_line,
)
from benchmarks.diagnosis_stability import agreement, loud_kinds

STRAGGLER = Scenario("slow-rank1", "test", ["+model.sleep_s=0.1"], [], "straggler", [1])
HEALTHY = Scenario("healthy", "test", [], ["+data.local_grads=true"], None)


def finding(kind: str, ranks: list[int], severity: str = "warning", cost: float | None = None, **evidence) -> dict:
    out = {"kind": kind, "ranks": ranks, "severity": severity, "evidence": evidence, "message": "m"}
    if cost is not None:
        out["cost"] = {"fraction": cost, "basis": "test"}
    return out


def ran(throughput: float, *findings: dict) -> RunResult:
    """A finished run with this throughput (tokens/s) and report findings."""
    return RunResult(True, throughput, findings=list(findings))


def test_right_top_finding_and_cost_within_five_points_meet_both_targets() -> None:
    faults = [ran(700.0, finding("straggler", [1], cost=0.32, slow_phase="forward")),
              ran(800.0, finding("straggler", [1], cost=0.28))]  # fmt: skip
    counterfactuals = [ran(1000.0), ran(1000.0)]
    verdict = judge(STRAGGLER, faults, counterfactuals)
    assert verdict.measured_cost == pytest.approx(0.25)  # median of 30% and 20%
    assert verdict.cost_spread == pytest.approx((0.2, 0.3))
    assert verdict.reported_cost == pytest.approx(0.30)
    assert verdict.points_apart == pytest.approx(5.0)
    assert verdict.targets == {"top finding and rank": True, "cost within 5 points": True}
    assert verdict.tops[0] == "straggler[1]/forward warning"


def test_waiting_rank_blamed_misses_the_rank_and_a_missing_cost_misses_the_cost_target() -> None:
    faults = [ran(700.0, finding("straggler", [0]), finding("input_bound", [1]))]
    verdict = judge(STRAGGLER, faults, [ran(1000.0)])
    assert verdict.kind_right and not verdict.ranks_right
    assert verdict.reported_cost is None
    assert verdict.targets == {"top finding and rank": False, "cost within 5 points": False}
    assert "n/a" in format_table([verdict])  # the reported cost column


def test_healthy_run_with_a_warning_misses_only_when_the_counterfactual_shows_under_five_percent() -> None:
    loud = [ran(980.0, finding("low_overlap", [1], "critical"), finding("low_mfu", [0, 1], "info"))]
    verdict = judge(HEALTHY, loud, [ran(1000.0)])
    assert verdict.loud_on_healthy == ["low_overlap[1] critical"]
    assert verdict.kind_right is None  # a healthy run is judged by its own target
    assert verdict.targets == {"quiet when healthy": False}
    # 20% to gain: a warning may be justified, so the healthy target does not apply.
    assert judge(HEALTHY, loud, [ran(1250.0)]).targets == {"quiet when healthy": None}
    quiet = judge(HEALTHY, [ran(990.0, finding("low_mfu", [0, 1], "info"))], [ran(1000.0)])
    assert quiet.targets == {"quiet when healthy": True}


def test_a_layouts_own_bubble_may_lead_but_the_fault_must_follow_it_loud_on_its_ranks() -> None:
    pipeline = Scenario("data-pp2", "test", [], [], "input_bound", [0, 1], inherent=("pipeline_bubble",))
    bubble = finding("pipeline_bubble", [0, 1], "critical", cost=0.4)
    found = judge(pipeline, [ran(700.0, bubble, finding("input_bound", [0, 1], cost=0.3))], [ran(1000.0)])
    assert found.targets["top finding and rank"] is True
    quiet = judge(pipeline, [ran(700.0, bubble, finding("input_bound", [0, 1], "info", cost=0.3))], [ran(1000.0)])
    assert quiet.targets["top finding and rank"] is False  # present but not loud: the fault was not reported
    wrong_rank = judge(pipeline, [ran(700.0, bubble, finding("input_bound", [1], cost=0.3))], [ran(1000.0)])
    assert wrong_rank.kind_right and not wrong_rank.ranks_right
    # Anything else leading the report is still a miss, and a healthy run of the layout may raise its bubble.
    assert judge(pipeline, [ran(700.0, finding("straggler", [1]))], [ran(1000.0)]).kind_right is False
    healthy = Scenario("none-pp2", "test", [], [], None, inherent=("pipeline_bubble",))
    assert judge(healthy, [ran(995.0, bubble)], [ran(1000.0)]).targets == {"quiet when healthy": True}


def test_failed_runs_are_listed_and_their_targets_not_judged() -> None:
    verdict = judge(STRAGGLER, [RunResult(False, error="exit 1: boom")], [ran(1000.0)])
    assert verdict.targets == {"top finding and rank": None, "cost within 5 points": None}
    table = format_table([verdict])
    assert "slow-rank1: run failed: exit 1: boom" in table
    assert targets_line([verdict]) == "targets met: 0 of 0"


def test_targets_line_counts_and_names_the_misses() -> None:
    good = judge(STRAGGLER, [ran(750.0, finding("straggler", [1], cost=0.25))], [ran(1000.0)])
    bad = judge(HEALTHY, [ran(1000.0, finding("comm_bound", [0, 1]))], [ran(1000.0)])
    assert targets_line([good, bad]) == "targets met: 2 of 3; missed: healthy: quiet when healthy"


def test_bubble_cost_is_the_schedules_share_that_does_not_grow_with_the_micro_batches() -> None:
    bubble = Scenario("bubble", "test", [], [], "pipeline_bubble", [0, 1], microbatches=(2, 8))
    # t(m) = 0.1 s per micro-batch + 0.1 s fixed: at m=2 the fixed part is a third of the 0.3 s step ...
    fault = RunResult(True, step_s=0.3, findings=[finding("pipeline_bubble", [0, 1], cost=0.25)], outside_s=0.03)
    verdict = judge(bubble, [fault], [RunResult(True, step_s=0.9)])
    # ... of which 0.03 s ran outside the schedule (the optimizer step): not bubble.
    assert verdict.measured_cost == pytest.approx(0.07 / 0.3)
    assert verdict.targets == {"top finding and rank": True, "cost within 5 points": True}


def test_the_time_outside_a_pipeline_schedule_comes_from_the_step_records(tmp_path) -> None:
    """Step time minus the schedule's wall time (its forward and backward compute plus its wait)."""
    telemetry = tmp_path / "telemetry"
    telemetry.mkdir()
    records = [{"kind": "meta", "tokens_per_step": 1024}]
    records += [{"kind": "step", "step": i, "step_s": 0.5, "forward_s": 0.1, "backward_s": 0.2, "bubble_fraction": 0.3}
                for i in range(2, 7)]  # fmt: skip
    (telemetry / "rank0000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tokens, step_s, outside_s, _ = median_step(tmp_path)
    assert (tokens, step_s) == (1024, 0.5) and outside_s == pytest.approx(0.5 - 0.1 - 0.2 - 0.15)
    result = load_run(tmp_path)  # no report: no findings
    assert result.ok and result.throughput == pytest.approx(2048) and result.outside_s == pytest.approx(0.05)
    assert result.findings == []


def test_the_mean_step_keeps_stalls_and_drops_the_runs_end_and_one_off_pauses(tmp_path) -> None:
    """Every 5th step a stall at 4x the step (the largest fault the matrix injects) stays in the mean; a pause at
    25x (both ranks stopped at one collective) and the last step (the run's end) do not."""
    telemetry = tmp_path / "telemetry"
    telemetry.mkdir()
    times = {i: 0.04 if i % 5 == 0 else 0.01 for i in range(2, 62)}
    times[34], times[61] = 0.25, 0.08
    records = [{"kind": "meta", "tokens_per_step": 16}]
    records += [{"kind": "step", "step": i, "step_s": t} for i, t in times.items()]
    (telemetry / "rank0000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    _, step_s, _, mean_s = median_step(tmp_path)
    kept = [t for i, t in times.items() if i not in (34, 61)]
    assert step_s == 0.01 and mean_s == pytest.approx(sum(kept) / len(kept))
    assert mean_s == pytest.approx((0.04 * 12 + 0.01 * 46) / 58)


def test_stability_compares_sets_of_loud_kinds_and_optionally_their_ranks() -> None:
    run = ran(1.0, finding("straggler", [1]), finding("low_mfu", [0, 1], "info"))
    assert loud_kinds(run) == ["straggler[1]"]
    assert agreement([["straggler[1]"], ["straggler[1]"], None]) is True
    assert agreement([["straggler[1]"], ["straggler[0]"]]) is True  # the same kind...
    assert agreement([["straggler[1]"], ["straggler[0]"]], with_ranks=True) is False  # ...on another rank
    assert agreement([["straggler[1]", "low_overlap[0]"], ["straggler[1]"]]) is False
    assert agreement([["straggler[1]"], None]) is None


def test_a_cells_faulty_runs_are_judged_against_the_counterfactuals_that_bracket_them() -> None:
    from benchmarks.diagnosis_accuracy import bracket, judge_draw
    from benchmarks.diagnosis_matrix import Draw

    before = RunResult(True, 1000.0, 1000.0, 0.1)
    after = RunResult(True, 800.0, 900.0, 0.12)  # the box slowed down during the cell
    base = bracket(before, after)
    assert (base.throughput, base.mean_throughput, base.step_s) == pytest.approx((900.0, 950.0, 0.11))
    assert bracket(RunResult(False, error="x"), after) is after
    slow = Draw("ddp", "backward", 1, 0.5, "user")
    found = RunResult(True, 600.0, 665.0, findings=[finding("straggler", [1], "critical", cost=0.33)])
    verdict = judge_draw(slow, 0.1, [found], [base])
    assert verdict.measured_cost == pytest.approx(0.30)  # on the mean throughput: 1 - 665 / 950
    assert verdict.targets == {"top finding and rank": True, "cost within 7 points": True}
    # Under a pipeline, the layout's bubble may lead when the injected input stall follows it, loud.
    piped = Draw("megatron-pp2", "data-all", None, 0.3, "builtin")
    run = RunResult(True, 700.0, 700.0, findings=[finding("pipeline_bubble", [0, 1], "critical", cost=0.4),
                                                  finding("input_bound", [0, 1], cost=0.28)])  # fmt: skip
    assert judge_draw(piped, 0.1, [run], [base]).targets["top finding and rank"] is True


def test_a_cell_gives_every_draw_its_own_run_directories(tmp_path, monkeypatch) -> None:
    """A seed may draw one scenario twice, and two cells may share strategy and model (a healthy DDP draw's
    counterfactual keeps its gradients local): no two runs of a matrix share a run directory."""
    import benchmarks.diagnosis_accuracy as accuracy
    from benchmarks.diagnosis_matrix import Draw

    used: list[str] = []

    def fake_run(overrides: list[str], run_dir, base=None) -> RunResult:
        assert run_dir.name not in used, run_dir.name
        used.append(run_dir.name)
        return RunResult(True, 1000.0, 1000.0, 0.1)

    monkeypatch.setattr(accuracy, "run_train", fake_run)
    twice = [Draw("ddp", "data-one", 1, 0.5, "hf"), Draw("ddp", "data-one", 1, 0.5, "hf")]
    assert len(accuracy.measure_cell(twice, 1, tmp_path, "cell00-ddp-hf")) == 2
    healthy = [Draw("ddp", "none", None, 0.0, "hf")]
    accuracy.measure_cell(healthy, 1, tmp_path, "cell01-ddp-hf")
    # 2 counterfactuals + 2 faults + 2 lever arms (amortized, local gradients), then 2 + 1 + 1 (amortized only)
    assert len(used) == len(set(used)) == 10


def test_each_faulty_run_is_judged_against_the_counterfactuals_just_before_and_after_it(tmp_path, monkeypatch) -> None:
    """A cell of three draws: counterfactual, two faulty runs, counterfactual, one faulty run, counterfactual.
    The box speeds up over the cell: the third draw's baseline is the mean of the last two counterfactuals, not
    of the cell's first and last."""
    import benchmarks.diagnosis_accuracy as accuracy
    from benchmarks.diagnosis_matrix import Draw

    speeds = iter([1000.0, 1400.0, 2000.0])  # the three counterfactual runs, in order
    runs: list[str] = []

    def fake_run(overrides: list[str], run_dir, base=None) -> RunResult:
        runs.append(run_dir.name)
        if "counterfactual" in run_dir.name:
            v = next(speeds)
            return RunResult(True, v, v, 0.1)
        return RunResult(True, 850.0, 850.0, 0.1)

    monkeypatch.setattr(accuracy, "run_train", fake_run)
    draws = [Draw("ddp", "data-one", 1, 0.5, "builtin"), Draw("ddp", "data-all", None, 0.5, "builtin"),
             Draw("ddp", "data-one", 0, 0.5, "builtin")]  # fmt: skip
    verdicts = accuracy.measure_cell(draws, 1, tmp_path, "cell00-ddp-builtin")
    assert [n.split("-")[-2] for n in runs[:-2]] == ["counterfactual", "fault", "fault", "counterfactual", "fault",
                                                     "counterfactual"]  # fmt: skip
    assert runs[-2:] == ["cell00-ddp-builtin-amortized", "cell00-ddp-builtin-local-grads"]
    assert verdicts[0].measured_cost == pytest.approx(1 - 850 / 1200)
    assert verdicts[2].measured_cost == pytest.approx(1 - 850 / 1700)


def test_host_overhead_on_a_healthy_run_is_judged_against_the_run_at_twice_its_micro_batch(tmp_path, monkeypatch):
    """A tiny module's healthy run whose step is mostly Python: host_overhead's warning is justified where the
    cell's run at twice the micro-batch gains HEALTHY_GAIN or more, and a false alarm where it gains less."""
    import benchmarks.diagnosis_accuracy as accuracy
    from benchmarks.diagnosis_matrix import Draw

    healthy = Draw("deepspeed-2", "none", None, 0.0, "lit-conv")
    assert healthy.amortized()[-1] == "trainer.micro_batch_size=128"
    assert Draw("ddp", "none", None, 0.0, "lit-embed").amortized()[-1] == "trainer.micro_batch_size=512"
    assert "+data.local_grads=true" in Draw("ddp", "none", None, 0.0, "user").amortized()  # its own counterfactual
    stall = Draw("ddp", "stall", 0, 0.2, "lit-conv", every=5)  # DDP's comm measured without its all-reduce
    assert [(kinds, arm) for kinds, arm, _ in stall.lever_arms()] == [
        (("host_overhead",), "amortized"), (("comm_bound", "low_overlap"), "local-grads")]  # fmt: skip
    assert "+data.local_grads=true" in stall.lever_arms()[1][2]
    assert [arm for _, arm, _ in healthy.lever_arms()] == ["amortized"]  # ZeRO's comm has no local arm

    def cell(amortized_rate: float) -> dict[str, bool | None]:
        def fake_run(overrides: list[str], run_dir, base=None) -> RunResult:
            rate = amortized_rate if run_dir.name.endswith("amortized") else 1000.0
            overhead = finding("host_overhead", [0, 1], "warning", cost=0.2)
            return RunResult(True, rate, rate, 0.01, findings=[overhead])

        monkeypatch.setattr(accuracy, "run_train", fake_run)
        return accuracy.measure_cell([healthy], 1, tmp_path / str(amortized_rate), "cell")[0].targets

    assert cell(1250.0) == {"quiet when healthy": True}  # 20% to gain: the warning has its counterfactual
    assert cell(1020.0) == {"quiet when healthy": False}  # 2%: nothing to gain, a healthy run's false alarm
    assert accuracy.lever_gain([], RunResult(True, 1.0, 1.0)) is None
