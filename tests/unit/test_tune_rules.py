"""The decision rules of ``python -m tune``: what keeps the training math, which lever goes first, when a tested
lever is kept, when the tune stops and what the budget pays for; the loss reader and the advice ledger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diagnostics.ab import ledger
from diagnostics.ab.runner import Arm, Launcher, RunOutcome
from diagnostics.diagnosis import analyse
from diagnostics.recommend import recommend_all
from disttrain.tune.levers import classify, global_pin
from disttrain.tune.loop import Tuner
from disttrain.tune.losses import read_losses
from disttrain.tune.rules import (
    candidates,
    carried_over,
    decide,
    inconclusive_reason,
    loss_gap,
    repeats_that_fit,
    retarget,
    retry_rounds,
    stop_reason,
    unsettled,
)
from disttrain.tune.settings import TuneSettings
from tests.diag_fixtures import write_run

KEEP_GLOBAL = ("trainer.global_batch_size=32",)


@pytest.mark.parametrize(
    ("key", "value", "pinned", "lever", "preserves"),
    [
        ("+data.num_workers", "2", (), "loader", True),
        ("strategy.bucket_cap_mb", "100", (), "buckets", True),
        ("strategy.comm_hook", "powersgd", (), "comm_hook", True),
        ("strategy.comm_hook", "bf16", (), "lossy_comm", False),  # rounded in transit, no error feedback
        ("strategy.activation_checkpointing", "true", (), "checkpointing", True),
        ("strategy.reshard_after_forward", "false", (), "resharding", True),
        ("model.compile", "true", (), "compile", True),
        ("trainer.micro_batch_size", "8", KEEP_GLOBAL, "micro_batch", True),  # more accumulation, same batch
        ("trainer.micro_batch_size", "32", (), "global_batch", False),  # the global batch doubles with it
        ("trainer.micro_batch_size", "8", ("trainer.global_batch_size=64",), "global_batch", False),
        ("strategy", "fsdp", (), "layout", True),
        ("trainer.global_batch_size", "64", (), "global_batch", False),
        ("precision", "bf16-mixed", (), "precision", False),
        ("optimizer.lr", "0.001", (), "other", False),
        ("some.unknown_key", "1", (), "other", False),
        ("trainer.val_every_n_steps", "50", (), "pauses", False),  # the user's trade-off, never tried by tune
        ("trainer.ckpt_every_n_steps", "500", (), "pauses", False),
    ],
)
def test_lever_classes(key: str, value: str, pinned: tuple[str, ...], lever: str, preserves: bool) -> None:
    got = classify(key, value, pinned, global_batch=32)
    assert (got.name, got.preserves_math) == (lever, preserves)


def test_powersgd_without_error_feedback_changes_the_math() -> None:
    lever = classify("strategy.comm_hook", "powersgd", (), 32, error_feedback=False)
    assert (lever.name, lever.preserves_math) == ("lossy_comm", False)


def test_a_layout_change_is_pinned_to_the_global_batch_unless_already_pinned() -> None:
    layout = classify("strategy.tp", "1", (), 32)
    assert global_pin(layout, ["strategy=megatron", "strategy.tp=1"], 32) == "trainer.global_batch_size=32"
    assert global_pin(layout, ["trainer.global_batch_size=32", "strategy.tp=1"], 32) is None
    assert global_pin(layout, ["strategy.tp=1"], None) is None  # unknown: nothing to pin to
    assert global_pin(classify("model.compile", "true", (), 32), ["model.compile=true"], 32) is None


def test_candidates_go_by_expected_gain_and_skip_math_changes_unless_allowed(tmp_path: Path) -> None:
    analysis = analyse(write_run(tmp_path / "comm", "comm_bound"))
    recs = recommend_all(analysis)
    found, skipped = candidates(analysis, recs, [], allow=(), min_cost=0.05)
    gains = [c.expected_gain for c in found]
    assert gains == sorted(gains, reverse=True) and found
    assert all(c.lever.preserves_math for c in found)
    assert "strategy.comm_hook=powersgd" in [c.override for c in found]
    assert [s.override for s in skipped if s.override.startswith("trainer.global_batch_size")]
    assert all("tune.allow=[" in s.reason for s in skipped if s.override)
    opened, _ = candidates(analysis, recs, [], allow=("global_batch", "lossy_comm"), min_cost=0.05)
    overrides = [c.override for c in opened]
    assert any(o.startswith("trainer.global_batch_size=") for o in overrides) and "strategy.comm_hook=bf16" in overrides
    tried = {found[0].override}
    assert found[0].override not in [c.override for c in candidates(analysis, recs, [], (), 0.05, tried)[0]]
    # Every candidate's A/B arm carries the finding it answers (for the advice ledger).
    assert {c.test.finding for c in found} == {c.finding for c in found}


def test_a_straggler_has_no_lever_and_the_tune_names_the_rank_and_the_cause(tmp_path: Path) -> None:
    analysis = analyse(write_run(tmp_path / "slow", "straggler"))
    found, skipped = candidates(analysis, recommend_all(analysis), [], allow=(), min_cost=0.05)
    assert found == []
    (note,) = [s for s in skipped if s.finding == "straggler"]
    assert note.override == "" and note.ranks == (2,) and "rank 2" in note.reason and "slow in" in note.reason


def test_a_healthy_run_has_nothing_costly_to_tune(tmp_path: Path) -> None:
    analysis = analyse(write_run(tmp_path / "ok", "healthy"))
    assert candidates(analysis, recommend_all(analysis), [], allow=(), min_cost=0.05) == ([], [])
    assert not [f for f in analysis.findings if f.cost_fraction >= 0.05]


def test_loss_gap_is_the_largest_relative_difference_over_shared_steps() -> None:
    base = {10: 2.0, 20: 1.0}
    assert loss_gap([(base, {10: 2.0, 20: 1.0})]) == 0.0
    assert loss_gap([(base, {10: 2.1, 20: 1.0}), (base, {10: 2.0, 20: 0.97, 30: 5.0})]) == pytest.approx(0.05)
    assert loss_gap([(base, {15: 2.0})]) is None  # no step in common: the math cannot be checked


def test_keep_only_confirmed_levers_whose_losses_stay_within_tolerance() -> None:
    loader, precision = classify("data.num_workers", "2", (), 32), classify("precision", "bf16-mixed", (), 32)
    assert decide("confirmed", loader, 0.01, 0.02).keep
    assert not decide("confirmed", loader, 0.03, 0.02).keep
    assert "3.00% (> tolerance 2.00%)" in decide("confirmed", loader, 0.03, 0.02).reason
    assert not decide("confirmed", loader, None, 0.02).keep
    for verdict in ("no measurable effect", "worse", "failed", "inconclusive"):
        assert not decide(verdict, loader, 0.0, 0.02).keep
    assert decide("confirmed", precision, 0.2, 0.02).keep  # allowed to change the math: losses differ by design
    assert not decide("worse", precision, 0.0, 0.02).keep


def test_the_budget_pays_for_whole_ab_rounds_only() -> None:
    assert repeats_that_fit(remaining_s=600, run_s=50, repeats=3, max_repeats=10) == 6  # 6 rounds of 2 x 50 s
    assert repeats_that_fit(600, 50, 3, 4) == 4
    assert repeats_that_fit(250, 50, 3, 10) == 0  # 2 rounds fit: below the minimum, the test is not started
    assert repeats_that_fit(-5, 50, 3, 10) == 0


def test_stop_rules_in_order() -> None:
    assert stop_reason(0, 3, 0, 4, 6, 0.05) == "no finding costs 5% of the step or more"
    assert stop_reason(2, 0, 0, 4, 6, 0.05) == "no config lever left for the costly findings"
    assert stop_reason(2, 1, 4, 4, 6, 0.05) == "tune.max_rounds=4 A/B tests done"
    assert "budget" in (stop_reason(2, 1, 1, 4, 0, 0.05) or "")
    assert stop_reason(2, 1, 1, 4, 3, 0.05) is None


def test_losses_from_the_csv_log_else_the_final_loss(tmp_path: Path) -> None:
    (tmp_path / "a" / "metrics").mkdir(parents=True)
    (tmp_path / "a" / "metrics" / "metrics.csv").write_text(
        "step,train/loss,val/loss\n4,2.5,\n4,,2.6\n9,2.25,\n9,nan,\n"
    )
    assert read_losses(tmp_path / "a") == {4: 2.5, 9: 2.25}
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "run.json").write_text(json.dumps({"result": {"steps": 30, "train_loss": 1.5}}))
    assert read_losses(tmp_path / "b") == {30: 1.5}
    assert read_losses(tmp_path / "missing") == {}


def test_ledger_lives_in_the_output_root_and_scores_advice_per_kind(tmp_path: Path) -> None:
    run = tmp_path / "outputs" / "2026-11-27" / "08-17-43"
    assert ledger.output_root(run) == (tmp_path / "outputs").resolve()
    assert ledger.output_root(tmp_path / "runs" / "a") == (tmp_path / "runs").resolve()
    tested = [
        {"override": "a=1", "expected_change": 0.25, "change": 0.05, "ci": [0.01, 0.09], "verdict": "confirmed"},
        {
            "override": "b=1",
            "expected_change": 0.10,
            "change": 0.0,
            "ci": [-0.02, 0.02],
            "verdict": "no measurable effect",
        },
        {"override": "c=1", "expected_change": None, "change": 0.3, "ci": [0.2, 0.4], "verdict": "confirmed"},
    ]
    kinds = ["comm_bound", "comm_bound", "input_bound"]
    entries = [ledger.entry(t, k, {"strategy": "ddp"}, "tune", run) for t, k in zip(tested, kinds, strict=True)]
    path = ledger.append(ledger.output_root(run), entries)
    assert ledger.find_ledger(run) == path and ledger.find_ledger(tmp_path / "outputs") == path
    # A tune's runs (outputs/<date>/<time>/round1/01-A) share the ledger of their output root too.
    assert ledger.output_root(run / "round1" / "01-A") == (tmp_path / "outputs").resolve()
    comm, inp = ledger.score_by_kind(ledger.read(path))
    assert (comm.finding, comm.tests, comm.confirmed, comm.scored) == ("comm_bound", 2, 1, 2)
    assert comm.median_abs_error == pytest.approx((0.20 + 0.10) / 2)
    assert comm.median_error == pytest.approx(-0.15)  # the advice promised more than it delivered
    assert (inp.scored, inp.median_measured, inp.median_abs_error) == (0, 0.3, None)
    text = ledger.advice_text(ledger.read(path), path)
    assert "comm_bound" in text and "-15.0pt" in text


def test_an_untested_lever_of_an_earlier_diagnosis_is_carried_over_against_the_current_config(tmp_path: Path) -> None:
    analysis = analyse(write_run(tmp_path / "comm", "comm_bound"))
    found, _ = candidates(analysis, recommend_all(analysis), ["trainer.max_steps=30"], allow=(), min_cost=0.05)
    first, second = found[0], found[1]
    carried = carried_over([second], found, tried={first.override})
    assert [c.override for c in carried] == [c.override for c in found[2:]]  # neither tested nor found again
    current = ["trainer.max_steps=30", "+data.num_workers=2", "strategy.bucket_cap_mb=5"]
    fsdp = retarget(found[-1], current)
    assert found[-1].override == "strategy=fsdp" and fsdp.test.original == tuple(current)
    # The new strategy's overrides replace the old strategy's keys (bucket_cap_mb is DDP's); the rest is kept.
    assert fsdp.test.recommended == (
        "trainer.max_steps=30",
        "+data.num_workers=2",
        "strategy=fsdp",
        "trainer.global_batch_size=32",
    )
    hook = retarget(found[1], [*current, "strategy.comm_hook=bf16"])
    assert hook.test.recommended == (*current, "strategy.comm_hook=powersgd")


def test_only_an_ab_that_settled_nothing_is_retried() -> None:
    assert unsettled("no measurable effect", resolved=False)  # CI straddles zero, too wide to rule out 3%
    assert unsettled("inconclusive", resolved=False)  # fewer than 2 complete pairs
    assert not unsettled("no measurable effect", resolved=True)  # within +-3%: an answer, no effect worth having
    for verdict in ("confirmed", "worse", "failed"):
        assert not unsettled(verdict, resolved=True)
    assert not unsettled("failed", resolved=False)  # a change that breaks runs is not retried


def test_a_retry_gets_more_rounds_than_the_first_ab_up_to_twice_as_many_as_the_budget_allows() -> None:
    assert retry_rounds(3, remaining_s=1000, run_s=50) == (4, 6)  # 10 rounds of 2 x 50 s fit: capped at 2 x 3
    assert retry_rounds(6, remaining_s=1000, run_s=50) == (7, 10)  # the budget caps it, above the first's 6
    assert retry_rounds(3, remaining_s=350, run_s=50) is None  # 3 rounds fit: no more than the first had
    assert retry_rounds(0, remaining_s=1000, run_s=50) == (1, 2)  # the first had no complete pair
    reason = inconclusive_reason(9, (-0.12, 0.15), "retried once with more rounds")
    assert reason == "not kept: inconclusive after 9 rounds (last 95% CI -12.0%..+15.0%); retried once with more rounds"


def _noisy_launcher(tokens_of_b: list[float], calls: list[str], label: str = "tokens/s") -> Launcher:
    """A launcher writing the recorded comm-bound run (tests.diag_fixtures) for every arm, with the original arm at
    1,000 tokens/s and the tested arm at the next of ``tokens_of_b``: verdicts chosen by the test, no processes."""
    b_runs = iter(tokens_of_b)

    def launch(arm: Arm, run_dir: Path) -> RunOutcome:
        write_run(run_dir, "comm_bound")
        (run_dir / "metrics").mkdir(exist_ok=True)
        (run_dir / "metrics" / "metrics.csv").write_text("step,train/loss\n9,2.0\n19,1.0\n")
        calls.append(arm.name)
        rate = 1000.0 if arm.name == "A" else next(b_runs)  # A: start, original
        return RunOutcome(run_dir, rate, None, 1.0, rate_label=label)

    return launch


def _tune(
    tmp_path: Path, tokens_of_b: list[float], max_rounds: int, label: str = "tokens/s"
) -> tuple[Tuner, list[str], list[str]]:
    settings = TuneSettings(60.0, 20, max_rounds, (), 3, 3, 0.02, 0.05, None)
    calls: list[str] = []
    said: list[str] = []
    launch = _noisy_launcher(tokens_of_b, calls, label)
    tuner = Tuner([], settings, tmp_path / "tune", set(), launch, said.append)
    tuner.run()
    return tuner, calls, said


def test_an_unsettled_ab_is_retried_once_with_more_rounds_then_dropped_as_inconclusive(tmp_path: Path) -> None:
    noise = [800.0, 1250.0] * 10  # ln(B/A) = -0.22, +0.22, ...: mean near zero, an interval far wider than 3%
    tuner, calls, said = _tune(tmp_path, noise, max_rounds=3)
    first, retry, third = tuner.summary.rows
    assert (first.pairs, first.retry, retry.pairs, retry.retry) == (3, False, 6, True)  # twice the rounds
    assert first.override == retry.override and third.override != first.override  # then the next lever
    assert not first.resolved and not retry.kept and retry.set_dir == "round2"
    assert retry.reason.startswith("not kept: inconclusive after 9 rounds (last 95% CI ")
    assert retry.reason.endswith("; retried once with more rounds")
    # The third lever's A/B is unsettled too, and no A/B test is left for its retry.
    assert third.reason.startswith("not kept: inconclusive after 3 rounds")
    assert third.reason.endswith("tune.max_rounds=3 leaves no A/B test for a retry")
    assert [d["override"] for d in tuner.summary.inconclusive] == [first.override, third.override]
    assert calls.count("B1") == 3 + 6 + 3
    assert any(line.startswith(f"tune: retrying {first.override}: inconclusive after 3 rounds") for line in said)
    assert f"tune: dropped: {first.override} ({first.finding}): inconclusive after 9 rounds" in "\n".join(said)
    summary = json.loads((tmp_path / "tune" / "tune" / "summary.json").read_text())
    assert summary["inconclusive"][0]["reason"].startswith("inconclusive after 9 rounds")
    assert "## Levers dropped unsettled" in (tmp_path / "tune" / "tune" / "summary.md").read_text()


def test_a_retry_that_confirms_the_lever_keeps_it(tmp_path: Path) -> None:
    # Unsettled over the first 3 rounds; the retry's 4 rounds are all 30% faster: confirmed after its minimum.
    tuner, calls, _ = _tune(tmp_path, [800.0, 1250.0, 1000.0] + [1300.0] * 4, max_rounds=2)
    first, retry = tuner.summary.rows
    assert not first.kept and "inconclusive" not in first.reason
    assert (retry.retry, retry.pairs, retry.verdict, retry.kept) == (True, 4, "confirmed", True)
    assert tuner.summary.inconclusive == [] and tuner.summary.changes() == [first.override]
    assert calls.count("B1") == 3 + 4  # the retry stopped at its minimum: settled


def test_a_sample_runs_tune_speaks_samples_per_s(tmp_path: Path) -> None:
    """A LightningModule's runs count samples: every line, the summary and the A/B verdict say samples/s."""
    tuner, _, said = _tune(tmp_path, [1300.0] * 3, max_rounds=1, label="samples/s")
    (row,) = tuner.summary.rows
    assert row.kept and tuner.summary.rate_label == "samples/s"
    text = "\n".join(said)
    assert "tune: round 0 (start): 1,000 samples/s" in text and "1,300 samples/s" in text
    assert "tokens/s" not in text
    summary = json.loads((tmp_path / "tune" / "tune" / "summary.json").read_text())
    assert summary["rate_label"] == "samples/s"
    (verdict,) = (tmp_path / "tune").rglob("verdict.json")
    (test,) = json.loads(verdict.read_text())["recommendations"]
    assert test["rate_label"] == "samples/s" and " samples/s, 95% CI" in test["reason"]
    assert "original samples/s" in verdict.with_suffix(".md").read_text()
