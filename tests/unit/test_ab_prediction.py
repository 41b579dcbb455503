"""A/B verdicts store the recommendation's expected change beside the measured one, and say how well they agree."""

from __future__ import annotations

import pytest

from diagnostics.ab.runner import plan_arms
from diagnostics.ab.verdict import expected_change, prediction_error_points, text_table
from diagnostics.recommend import AbTest


def test_a_saved_share_of_the_step_predicts_a_tokens_per_s_change() -> None:
    assert expected_change(0.5) == pytest.approx(1.0)  # half the step saved: twice the tokens/s
    assert expected_change(0.2) == pytest.approx(0.25)
    assert expected_change(None) is None and expected_change(1.0) is None


def test_the_recommended_arm_carries_the_expected_gain() -> None:
    test = AbTest("data.num_workers", (), "", ("a=1",), ("a=1", "data.num_workers=2"), "data.num_workers=2", 0.3)
    original, recommended = plan_arms([test])
    assert original.expected_gain is None and recommended.expected_gain == 0.3


def arm(rate: float) -> dict:
    return {"median_tokens_per_s": rate, "spread": 0.01}


def test_the_median_absolute_error_of_the_predictions_in_points() -> None:
    tests = [
        {"override": "x=1", "set": "set1", "verdict": "confirmed", "change": 0.30, "ci": [0.2, 0.4], "pairs": 3,
         "expected_change": 0.25, "prediction_error": 0.05, "original": arm(100), "recommended": arm(130)},
        {"override": "y=2", "set": "set1", "verdict": "worse", "change": -0.10, "ci": [-0.2, -0.05], "pairs": 3,
         "expected_change": 0.20, "prediction_error": -0.30, "original": arm(100), "recommended": arm(90)},
        {"override": "z=3", "set": "set1", "verdict": "no measurable effect", "change": 0.0, "ci": [-0.1, 0.1],
         "pairs": 3, "expected_change": None, "prediction_error": None, "original": arm(100), "recommended": arm(100)},
    ]  # fmt: skip
    data = {"recommendations": tests}
    assert prediction_error_points(data) == (pytest.approx(17.5), 2)
    text = text_table(data)
    assert "expected +25.0%" in text and "median absolute error 17.5 points over 2 test(s)" in text
