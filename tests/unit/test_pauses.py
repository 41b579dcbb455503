"""Validation and checkpoint writes: kept out of the step records (collect/steps), their share of the training
loop found (analysis/pauses), made rarer by the report (recommend.for_pauses) and A/B-tested on the loop's rate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diagnostics.ab.runner import AbSet, Arm, ArmRuns, RunOutcome
from diagnostics.ab.verdict import set_verdict, text_table
from diagnostics.collect.steps import PhaseTimer
from diagnostics.diagnosis import analyse
from diagnostics.kinds.pauses import periodic_count
from diagnostics.recommend import ab_tests, recommend_all
from tests.unit.test_collect import FakeClock

T0 = 1_700_000_000.0


def timer_with_clocks() -> tuple[PhaseTimer, FakeClock, FakeClock]:
    clock, wall = FakeClock(), FakeClock()
    wall.advance(T0)
    return PhaseTimer(clock=clock, wall_clock=wall), clock, wall


def advance(clocks: tuple[FakeClock, FakeClock], seconds: float) -> None:
    for c in clocks:
        c.advance(seconds)


def one_step(timer: PhaseTimer, clocks: tuple[FakeClock, FakeClock], seconds: float) -> None:
    timer.batch_start()
    advance(clocks, seconds / 2)
    timer.before_backward()
    advance(clocks, seconds / 4)
    timer.after_backward()
    timer.before_optimizer_step()
    advance(clocks, seconds / 4)


def test_a_save_in_the_steps_end_hooks_is_taken_out_of_that_step_and_recorded() -> None:
    timer, clock, wall = timer_with_clocks()
    clocks = (clock, wall)
    timer.finish_step()
    one_step(timer, clocks, 1.0)
    timer.pause_started("checkpoint")  # StepCheckpoint saves before the collector's own batch-end hook
    assert timer.phase == "checkpoint"
    advance(clocks, 3.0)
    phases = timer.finish_step()
    assert phases is not None
    assert phases.step_s == pytest.approx(1.0)
    assert phases.optimizer_s == pytest.approx(0.25)  # the optimizer step ended where the save began
    assert phases.other_s == pytest.approx(0.0)
    (pause,) = timer.take_pauses()
    assert (pause.what, pause.seconds, pause.start_t) == ("checkpoint", pytest.approx(3.0), pytest.approx(T0 + 1.0))
    one_step(timer, clocks, 1.0)
    after = timer.finish_step()
    assert after is not None and after.step_s == pytest.approx(1.0)
    assert after.start_t == pytest.approx(T0 + 4.0)  # the next step began when the save ended
    assert timer.take_pauses() == []


def test_a_save_between_steps_moves_the_next_steps_start_to_its_end() -> None:
    """A callback after the collector (Lightning's ModelCheckpoint runs last) saves after the step was closed: the
    next step starts where the save ends (its data fetch), on both clocks."""
    timer, clock, wall = timer_with_clocks()
    clocks = (clock, wall)
    timer.finish_step()
    advance(clocks, 0.5)
    timer.pause_started("checkpoint")
    advance(clocks, 2.0)
    from diagnostics.collect.steps import DataWaitProfiler

    profiler = DataWaitProfiler()
    profiler.timer = timer
    profiler.start("[_TrainingEpochLoop].train_dataloader_next")  # ends the save
    profiler.stop("[_TrainingEpochLoop].train_dataloader_next")
    one_step(timer, clocks, 1.0)
    phases = timer.finish_step()
    assert phases is not None
    assert phases.step_s == pytest.approx(1.5, abs=0.01)  # 0.5 s of hooks before the save, then the step
    assert phases.start_t == pytest.approx(T0 + 2.0)
    (pause,) = timer.take_pauses()
    assert pause.seconds == pytest.approx(2.0)


def test_a_checkpoint_saved_from_validation_is_part_of_the_validation_pause() -> None:
    timer, clock, wall = timer_with_clocks()
    timer.finish_step()
    timer.pause_started("validation")
    advance((clock, wall), 1.0)
    timer.pause_started("checkpoint")
    advance((clock, wall), 0.5)
    timer.pause_ended()
    timer.pause_ended()  # nothing under way: no-op
    assert [(p.what, p.seconds) for p in timer.take_pauses()] == [("validation", pytest.approx(1.5))]


# --- analysis over written telemetry -------------------------------------------------------------------------


def write_run(
    run_dir: Path,
    *,
    steps: int = 40,
    step_s: float = 0.1,
    pauses: dict[str, tuple[int, float]],
    max_steps: int | None = None,
    world: int = 2,
    slower_rank: int | None = None,
) -> Path:
    """Telemetry and run.json of a run whose steps take ``step_s`` and which pauses ``what`` every N steps for S
    seconds (``pauses = {what: (N, S)}``), at its last step too (the final validation and checkpoint)."""
    max_steps = max_steps or steps
    tele = run_dir / "telemetry"
    tele.mkdir(parents=True)
    for rank in range(world):
        t = T0
        lines = [{"kind": "meta", "rank": rank, "world_size": world, "tokens_per_step": 1000, "device": "cpu"}]
        for step in range(1, steps + 1):
            if step > 1:
                lines.append({"kind": "step", "rank": rank, "step": step, "step_s": step_s, "start_t": t,
                              "forward_s": step_s / 2, "backward_s": step_s / 2, "optimizer_s": 0.0,
                              "local_compute_s": step_s, "data_wait_s": 0.0, "comm_wait_s": 0.0})  # fmt: skip
            t += step_s
            for what, (every, seconds) in pauses.items():
                if step % every == 0 or step == max_steps:
                    held = seconds * (1.5 if rank == slower_rank else 1.0)
                    lines.append({"kind": "pause", "rank": rank, "what": what, "step": step, "seconds": held,
                                  "start_t": t})  # fmt: skip
                    t += seconds * (1.5 if slower_rank is not None else 1.0)
        (tele / f"rank{rank:04d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    config = {"trainer": {"max_steps": max_steps, "val_every_n_steps": pauses.get("validation", (1000, 0))[0],
                          "ckpt_every_n_steps": pauses.get("checkpoint", (1000, 0))[0]}}  # fmt: skip
    (run_dir / "run.json").write_text(json.dumps({"config": config, "status": "completed"}))
    return run_dir


def test_the_share_of_the_loop_in_pauses_is_found_the_last_steps_left_out(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", pauses={"validation": (5, 0.2), "checkpoint": (10, 0.1)})
    analysis = analyse(run)
    (finding,) = [f for f in analysis.findings if f.kind == "pauses"]
    # Steps 2..40 recorded: validations at 5..35 (7) and checkpoints at 10, 20, 30 inside; those at 40 after it.
    ev = finding.evidence
    assert ev["by_what"] == {"validation": {"count": 7, "seconds": 1.4}, "checkpoint": {"count": 3, "seconds": 0.3}}
    loop = 39 * 0.1 + 1.4 + 0.3
    assert ev["loop_s"] == pytest.approx(loop, rel=1e-3)
    assert finding.cost_fraction == pytest.approx(1.7 / loop, abs=1e-3)
    assert finding.severity == "critical" and finding.ranks == [0, 1]
    assert analysis.summary.loop["loop_tokens_per_s"] == pytest.approx(39 * 1000 / loop, rel=1e-3)
    assert analysis.summary.tokens_per_s == pytest.approx(1000 / 0.1, rel=1e-3)  # the steps' own rate is unchanged


def test_each_pause_counts_its_slowest_rank(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", pauses={"checkpoint": (5, 0.2)}, slower_rank=1)
    (finding,) = [f for f in analyse(run).findings if f.kind == "pauses"]
    assert finding.evidence["by_what"]["checkpoint"] == {"count": 7, "seconds": pytest.approx(7 * 0.3)}


@pytest.mark.parametrize("seconds", [0.0, 0.02])
def test_pauses_under_the_warning_cost_are_the_price_of_validating(tmp_path: Path, seconds: float) -> None:
    run = write_run(tmp_path / "run", pauses={"validation": (10, seconds)})
    analysis = analyse(run)
    assert not [f for f in analysis.findings if f.kind == "pauses"]
    assert analysis.summary.loop["share"] == pytest.approx(3 * seconds / (3.9 + 3 * seconds), abs=1e-3)


@pytest.mark.parametrize(("seconds", "share", "severity"), [(0.07, 0.0511, "info"), (0.12, 0.0845, "warning")])
def test_pauses_are_graded_on_what_rarer_intervals_can_return(
    tmp_path: Path, seconds: float, share: float, severity: str
) -> None:
    """The default run's 4-5% of validation is reported, as info: brought to the 2% a run keeps, 3 points come back."""
    run = write_run(tmp_path / "run", pauses={"validation": (10, seconds)})
    (finding,) = [f for f in analyse(run).findings if f.kind == "pauses"]
    assert finding.cost_fraction == pytest.approx(share, abs=1e-3)
    assert finding.evidence["reachable_share"] == pytest.approx(share - 0.02, abs=1e-3)
    assert finding.severity == severity


@pytest.mark.parametrize(("every", "max_steps", "expected"), [(5, 60, 11), (5, 61, 12), (50, 220, 4), (7, 7, 0)])
def test_periodic_count_leaves_out_the_pause_at_the_last_step(every: int, max_steps: int, expected: int) -> None:
    assert periodic_count(every, max_steps) == expected


def test_the_report_makes_each_costly_pause_rarer_and_tests_it_on_the_loops_rate(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", steps=100, pauses={"validation": (5, 0.6), "checkpoint": (10, 0.05)})
    analysis = analyse(run)
    (index,) = [i for i, f in enumerate(analysis.findings) if f.kind == "pauses"]
    finding, recs = analysis.findings[index], recommend_all(analysis)[index]
    shares = finding.evidence["share_by_what"]
    by_key = {r.key: r for r in recs}
    validation, checkpoint = by_key["trainer.val_every_n_steps"], by_key["trainer.ckpt_every_n_steps"]
    assert recs[0] is validation  # the costlier kind first
    # Validation, 52% of the loop: 27x rarer would bring it to 2%; capped at 19x, which keeps one of its 19
    # validations before the last step. Checkpoints, 2.1%: twice as rare at least.
    assert shares["validation"] == pytest.approx(11.4 / 21.75, abs=1e-3)
    assert shares["checkpoint"] == pytest.approx(0.45 / 21.75, abs=1e-3)
    assert validation.value == "95"
    assert validation.expected_gain["fraction"] == pytest.approx(shares["validation"] * (1 - 1 / 19), abs=1e-3)
    assert checkpoint.value == "20"
    assert checkpoint.expected_gain["fraction"] == pytest.approx(shares["checkpoint"] * (1 - 4 / 9), abs=1e-3)
    assert {validation.metric, checkpoint.metric} == {"loop_tokens_per_s"}
    tests = ab_tests(analysis, recommend_all(analysis), top_k=5)
    assert {t.metric for t in tests if t.finding == "pauses"} == {"loop_tokens_per_s"}


@pytest.mark.parametrize(
    ("config", "shown"),
    [({}, "no interval in the run's config"),
     ({"trainer": {"max_steps": 40, "val_every_n_steps": 0}}, "trainer.val_every_n_steps=0"),
     ({"trainer": {"max_steps": 40, "val_every_n_steps": 40}}, "trainer.val_every_n_steps=40")],
)  # fmt: skip
def test_a_pause_no_interval_of_the_config_makes_periodic_has_no_lever(
    tmp_path: Path, config: dict, shown: str
) -> None:
    """Pauses the run's config does not schedule (a user callback's saves, a signal's checkpoint): said, no override."""
    run = write_run(tmp_path / "run", pauses={"validation": (5, 0.3)})
    (run / "run.json").write_text(json.dumps({"config": config, "status": "completed"}))
    analysis = analyse(run)
    (index,) = [i for i, f in enumerate(analysis.findings) if f.kind == "pauses"]
    (rec,) = recommend_all(analysis)[index]
    assert rec.key is None and rec.why == f"No config lever: validations take 35% of the loop ({shown})"


def test_a_kind_of_pause_already_at_its_target_share_is_left_alone(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", steps=100, pauses={"validation": (5, 0.6), "checkpoint": (50, 0.05)})
    analysis = analyse(run)
    (index,) = [i for i, f in enumerate(analysis.findings) if f.kind == "pauses"]
    assert analysis.findings[index].evidence["share_by_what"]["checkpoint"] < 0.02
    assert [r.key for r in recommend_all(analysis)[index]] == ["trainer.val_every_n_steps"]


def test_an_ab_of_a_pause_lever_compares_the_loops_rate(tmp_path: Path) -> None:
    """The steps run at the same rate in both arms; only the loop's wall-clock rate shows the lever."""
    arms = [ArmRuns(Arm("A", "original", ("a=1",))),
            ArmRuns(Arm("B1", "trainer.val_every_n_steps=50", ("a=2",), 0.3, "loop_tokens_per_s"))]  # fmt: skip
    for r in range(1, 4):
        arms[0].rounds[r] = RunOutcome(tmp_path / f"{r}-A", 1000.0 + r, None, 1.0, 600.0 + r)
        arms[1].rounds[r] = RunOutcome(tmp_path / f"{r}-B1", 1000.0 - r, None, 1.0, 900.0 - r)
    ab = AbSet(tmp_path / "set1", arms, rounds=3)
    assert ab.aligned(arms[1]) == ([601.0, 602.0, 603.0], [899.0, 898.0, 897.0])
    verdict = set_verdict(ab, tmp_path)
    (test,) = verdict["recommendations"]
    assert test["metric"] == "loop_tokens_per_s"
    assert test["change"] == pytest.approx(0.49, abs=0.02)
    assert test["original"]["tokens_per_s"] == [601.0, 602.0, 603.0]
    assert "wall-clock tokens/s (validation and checkpoints included)" in text_table(verdict)
    assert RunOutcome(tmp_path, None, "failed", 1.0, 5.0).rate("loop_tokens_per_s") is None


def test_tune_never_tries_a_pause_lever_and_says_why(tmp_path: Path) -> None:
    """Tune's runs time the steps and save nothing: a pause lever would not show there, and how often to validate
    or save is the user's trade-off. Not even ``tune.allow`` with every class opens it."""
    from disttrain.tune.levers import MATH_CHANGING
    from disttrain.tune.rules import candidates

    analysis = analyse(write_run(tmp_path / "run", pauses={"validation": (5, 0.6), "checkpoint": (5, 0.2)}))
    found, skipped = candidates(analysis, recommend_all(analysis), [], MATH_CHANGING, 0.05)
    assert not [c for c in found if c.finding == "pauses"]
    reasons = {s.override.split("=")[0]: s.reason for s in skipped if s.finding == "pauses"}
    assert set(reasons) == {"trainer.val_every_n_steps", "trainer.ckpt_every_n_steps"}
    assert all("choice tune leaves to you" in r and "tune.allow" not in r for r in reasons.values())


def test_compare_shows_what_the_loop_delivered_beside_the_steps_rate(tmp_path: Path) -> None:
    from diagnostics.report import build_report
    from diagnostics.report.compare import compare_reports

    often = write_run(tmp_path / "a", pauses={"validation": (5, 0.6)})
    rarer = write_run(tmp_path / "b", pauses={"validation": (35, 0.6)})
    cmp = compare_reports(build_report(often), build_report(rarer))
    rows = {name: (a, b, change) for name, a, b, change in cmp.metrics}
    assert rows["tokens/s"][2] == "(same)"  # the steps ran alike
    a, b, change = rows["tokens/s with pauses"]
    # 39 steps of 0.1 s with 7 validations of 0.6 s inside the loop, then 1
    assert (a, b) == (f"{39_000 / 8.1:,.0f}", f"{39_000 / 4.5:,.0f}") and "(better)" in change
    assert "trainer.val_every_n_steps: 5 -> 35" in cmp.text()


def test_the_report_tables_the_loops_rate_and_its_pauses(tmp_path: Path) -> None:
    from diagnostics.report import build_report
    from diagnostics.report.markdown import summary_rows

    rows = dict(summary_rows(build_report(write_run(tmp_path / "run", pauses={"checkpoint": (5, 0.3)}))))
    row = str(rows["tokens/s with validation and checkpoints"])
    assert row.startswith(f"{39_000 / 6.0:,.0f} (35.0% of the loop's 6.00 s outside the steps: checkpoint 7x 2.10 s")
    quiet = dict(summary_rows(build_report(write_run(tmp_path / "quiet", pauses={}))))
    assert "tokens/s with validation and checkpoints" not in quiet
