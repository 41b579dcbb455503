"""How benchmarks/tune_accuracy.py scores tune's kept levers against its brute force (no runs)."""

from __future__ import annotations

import pytest

from benchmarks.tune_accuracy import judge_levers


def kept_row(expected: float | None, kept: bool = True) -> dict:
    return {"kept": kept, "expected_change": expected}


def test_expected_gain_compounds_over_kept_rounds_and_measured_is_tune_over_start() -> None:
    summary = {"rounds": [kept_row(0.5), kept_row(0.9, kept=False), kept_row(0.2)]}
    medians = {"start": 1000.0, "tune": 1700.0, "+data.num_workers=2": 1500.0}
    judged = judge_levers(summary, medians)
    assert judged["expected_gain"] == pytest.approx(1.5 * 1.2 - 1)  # the unkept round's promise does not count
    assert judged["measured_gain"] == pytest.approx(0.7)
    assert judged["right"] is True  # tune's config beats every single candidate


def test_a_better_candidate_than_tunes_config_makes_it_wrong() -> None:
    medians = {"start": 1000.0, "tune": 1000.0, "trainer.micro_batch_size=4": 1500.0}
    judged = judge_levers({"rounds": [kept_row(0.1, kept=False)]}, medians)
    assert judged == {"expected_gain": None, "measured_gain": 0.0, "right": False}
    # Nothing kept and nothing beats the start: keeping the start was right (one config, measured once).
    assert judge_levers({"rounds": []}, {"start": 900.0, "tune": 900.0, "x=1": 800.0})["right"] is True
