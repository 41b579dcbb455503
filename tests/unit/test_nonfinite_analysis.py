"""A run stopped or slowed by non-finite values is explained by its report: which step, what, what was done."""

from __future__ import annotations

import json
from pathlib import Path

from diagnostics.diagnosis import analyse
from diagnostics.recommend import ab_tests, recommend_all
from diagnostics.report import build_report, diagnose_run
from diagnostics.telemetry import TelemetryWriter
from tests.diag_fixtures import write_run

AGREED = "every rank agreed (the ranks vote; which rank's values turned non-finite first is not recorded)"


def overrides(recs: list) -> list[str]:
    return [r.override for r in recs]


def test_a_stopped_run_tops_its_report_with_the_stop_and_names_the_last_good_checkpoint(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "nonfinite_stop", nonfinite=(12,))
    analysis = analyse(run_dir)
    top = analysis.findings[0]
    assert (top.kind, top.severity, top.ranks) == ("nonfinite", "critical", [0, 1])
    assert top.cost["fraction"] == 1.0 and "stopped" in top.cost["basis"]
    last = str(run_dir / "checkpoints" / "step000010.ckpt")
    ev = top.evidence
    assert (ev["action"], ev["policy"], ev["stopped_at_step"], ev["what"]) == (
        "stopped",
        "stop",
        12,
        "loss and gradients",
    )
    assert (ev["steps_run"], ev["skipped_total"], ev["recorded_by"], ev["every_rank_agreed"]) == (13, 0, [0, 1], True)
    assert ev["last_good_checkpoint"] == last and ev["record"] == "telemetry nonfinite records"
    assert (
        top.message
        == f"non-finite loss and gradients at step 12: the run stopped; {AGREED}; last good checkpoint: {last}"
    )
    assert [f.kind for f in analysis.findings].count("nonfinite") == 1
    # The other findings rest on the 13 steps measured before the stop: graded no higher than warning.
    assert all(f.severity != "critical" for f in analysis.findings[1:])


def test_stop_recommendations_are_concrete_overrides_to_try_and_the_resume(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "nonfinite_stop", overrides=("precision=bf16-mixed",), nonfinite=(40,))
    recs = recommend_all(analyse(run_dir))[0]
    # The default config: lr 3e-3, warm-up 30 steps, clipping at 1.0 (no clip lever), nan_policy=stop.
    assert overrides(recs) == [
        "optimizer.lr=0.0015",
        "optimizer.warmup_steps=100",
        "precision=fp32",
        "trainer.nan_policy=skip",
        f"resume={run_dir}",
    ]
    assert "came after it" in recs[1].why  # the bad step (40) is past the 30-step warm-up
    assert all(r.expected_gain["basis"].startswith("not measured") and not r.ab_testable for r in recs)
    assert "a lower optimizer.lr needs a fresh run" in recs[-1].why
    assert ab_tests(analyse(run_dir), [recs], 3) == []  # A/B compares step times: not what these change


def test_levers_follow_the_config_that_ran(tmp_path: Path) -> None:
    run_dir = write_run(
        tmp_path / "run",
        "nonfinite_stop",
        overrides=("trainer.grad_clip=0", "optimizer.warmup_steps=200", "precision=bf16-true"),
        nonfinite=(4,),
        nonfinite_manifest=False,  # no run.json record: no checkpoint is known, nothing to resume from
    )
    analysis = analyse(run_dir)
    top = analysis.findings[0]
    assert top.kind == "nonfinite" and top.evidence["last_good_checkpoint"] is None
    assert top.evidence["policy"] == "stop"
    recs = recommend_all(analysis)[0]
    assert overrides(recs) == [
        "optimizer.lr=0.0015",
        "optimizer.warmup_steps=400",
        "trainer.grad_clip=1.0",
        "precision=bf16-mixed",
        "trainer.nan_policy=skip",
        "",
    ]
    assert "during it" in recs[1].why and recs[-1].why.startswith("No config lever: no checkpoint was saved")


def test_skipped_steps_cost_their_share_of_the_run(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "nonfinite_skip", nonfinite=(3, 9), nonfinite_what="gradients")
    (finding,) = [f for f in analyse(run_dir).findings if f.kind == "nonfinite"]
    assert (finding.severity, finding.cost["fraction"]) == ("warning", 0.1)  # 2 of 20 steps: on the usual scale
    ev = finding.evidence
    assert (ev["action"], ev["policy"], ev["skipped_steps"], ev["skipped_total"]) == ("skipped", "skip", [3, 9], 2)
    assert (ev["stopped_at_step"], ev["what"], ev["steps_run"]) == (None, "gradients", 20)
    assert "last_good_checkpoint" not in ev
    assert finding.message == (
        f"2 of 20 steps skipped with non-finite gradients (step 3, 9; nan_policy=skip): their updates were dropped; "
        f"{AGREED}"
    )
    one = write_run(tmp_path / "one", "nonfinite_skip", steps=40, nonfinite=(7,))
    (rare,) = [f for f in analyse(one).findings if f.kind == "nonfinite"]
    assert (rare.severity, rare.cost["fraction"]) == ("info", 0.025)  # 1 of 40 steps: below the 5% warning
    analysis = analyse(run_dir)
    recs = recommend_all(analysis)[[f.kind for f in analysis.findings].index("nonfinite")]
    # Already skipping: no nan_policy lever, and no resume (the run went on).
    assert overrides(recs) == ["optimizer.lr=0.0015", "optimizer.warmup_steps=100"]


def test_ranks_that_did_not_record_it_are_not_called_agreed(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "nonfinite_skip", nonfinite=(3,), nonfinite_ranks=(1,))
    (finding,) = [f for f in analyse(run_dir).findings if f.kind == "nonfinite"]
    assert finding.ranks == [1] and finding.evidence["every_rank_agreed"] is False
    assert finding.message.endswith("their updates were dropped; recorded by rank 1 of 2")


def test_without_telemetry_records_run_json_tells_the_stop(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "nonfinite_stop", nonfinite=(6,), nonfinite_ranks=())
    (finding,) = [f for f in analyse(run_dir).findings if f.kind == "nonfinite"]
    ev = finding.evidence
    assert (ev["record"], ev["stopped_at_step"], ev["what"], ev["recorded_by"]) == (
        "run.json nonfinite",
        6,
        "loss and gradients",
        [],
    )
    assert finding.ranks == [0, 1] and "which ranks saw it is not recorded" in finding.message


def test_a_run_without_nonfinite_records_has_no_such_finding(tmp_path: Path) -> None:
    for scenario in ("healthy", "input_bound", "crash"):
        analysis = analyse(write_run(tmp_path / scenario, scenario))
        assert "nonfinite" not in [f.kind for f in analysis.findings]


def test_every_report_format_renders_the_stop(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "nonfinite_stop", nonfinite=(12,))
    report = diagnose_run(run_dir)
    out = run_dir / "report"
    top = json.loads((out / "report.json").read_text())["findings"][0]
    assert (top["kind"], top["evidence"]["stopped_at_step"]) == ("nonfinite", 12)
    assert top["recommendations"][0]["override"] == "optimizer.lr=0.0015"
    markdown = (out / "report.md").read_text()
    assert "### critical: nonfinite (ranks 0, 1), costs 100% of the step" in markdown
    assert "No detector crossed its threshold" not in markdown
    assert "(not measured: whether it avoids the non-finite step shows in a rerun)" in markdown
    ab = markdown.partition("## A/B test the top recommendations")[2]
    assert "optimizer.lr" not in ab and "nan_policy" not in ab  # no stability lever is offered for A/B
    assert 'data-kind="nonfinite"' in (out / "report.html").read_text()
    summary = report.text_summary().splitlines()
    assert summary[0].endswith("; try optimizer.lr=0.0015 (not measured)")
    assert "non-finite loss and gradients at step 12: the run stopped" in summary[0]
    assert summary[2].startswith("  critical nonfinite [run stopped]: non-finite loss and gradients at step 12")
    rebuilt = build_report(run_dir)  # python -m diagnose reads the same files
    assert rebuilt.kinds() == report.kinds()


def test_more_skips_than_allowed_stop_the_run_after_the_skipped_steps(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "nonfinite_skip", nonfinite=(3, 9))
    for rank in (0, 1):  # trainer.max_nan_skips=2 reached: the guard stops at the third bad step
        writer = TelemetryWriter(run_dir, rank)
        writer.write("nonfinite", step=15, what="loss", action="stopped", skipped_total=2)
        writer.close()
    analysis = analyse(run_dir)
    top = analysis.findings[0]
    assert (top.kind, top.severity, top.cost["fraction"]) == ("nonfinite", "critical", 1.0)
    ev = top.evidence
    assert (ev["policy"], ev["stopped_at_step"], ev["what"], ev["skipped_steps"]) == ("skip", 15, "loss", [3, 9])
    assert top.message.startswith("non-finite loss at step 15 after 2 skipped step(s): the run stopped; every rank")
    assert "trainer.nan_policy=skip" not in overrides(recommend_all(analysis)[0])  # it was skipping already


def test_run_json_alone_does_not_guess_what_a_skipped_step_had(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "nonfinite_skip", nonfinite=(3, 9), nonfinite_ranks=())
    (finding,) = [f for f in analyse(run_dir).findings if f.kind == "nonfinite"]
    assert finding.evidence["record"] == "run.json nonfinite"
    assert finding.message.startswith("2 of 20 steps skipped with non-finite loss or gradients (step 3, 9;")
