"""The A/B statistics on synthetic arms: medians and spread, the paired interval, the verdict, when to add rounds."""

from __future__ import annotations

import math

import pytest

from diagnostics.ab.stats import RESOLUTION, arm_stats, judge, needs_more, paired_change, t_quantile

ORIGINAL = [1000.0, 1010.0, 990.0]


def test_arm_stats_median_and_spread_ignore_failed_runs() -> None:
    stats = arm_stats([1000.0, None, 1100.0, 900.0])
    assert (stats.runs, stats.failed) == (4, 1)
    assert (stats.median, stats.low, stats.high) == (1000.0, 900.0, 1100.0)
    assert stats.spread == pytest.approx(0.2)
    assert arm_stats([None, None]).median is None and arm_stats([None, None]).spread is None


def test_t_quantiles() -> None:
    assert t_quantile(2) == pytest.approx(4.303)
    assert t_quantile(30) == pytest.approx(2.042)
    assert t_quantile(200) == pytest.approx(1.972, abs=0.001)
    with pytest.raises(ValueError, match="at least 1"):
        t_quantile(0)


def test_interval_is_the_t_interval_of_paired_log_ratios() -> None:
    b = [1100.0, 1120.0, 1080.0]
    change = paired_change(ORIGINAL, b)
    logs = [math.log(y / x) for x, y in zip(ORIGINAL, b, strict=True)]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in logs) / 2)
    assert change is not None and change.pairs == 3
    assert change.estimate == pytest.approx(math.exp(mean) - 1)
    assert change.low == pytest.approx(math.exp(mean - 4.303 * sd / math.sqrt(3)) - 1)
    assert change.high == pytest.approx(math.exp(mean + 4.303 * sd / math.sqrt(3)) - 1)


def test_pairing_cancels_drift_that_hits_a_whole_round() -> None:
    # The machine slows down by 30% over the test; B is 10% faster than A within every round.
    a = [1000.0, 850.0, 700.0]
    verdict = judge(a, [v * 1.10 for v in a])
    assert verdict.verdict == "confirmed"
    assert verdict.change is not None and verdict.change.estimate == pytest.approx(0.10)
    assert verdict.original.spread == pytest.approx(300 / 850)  # the arms themselves look very noisy


def test_confirmed() -> None:
    verdict = judge(ORIGINAL, [1100.0, 1120.0, 1080.0])
    assert verdict.verdict == "confirmed" and verdict.change.low > 0
    assert verdict.reason == "+10.0% tokens/s, 95% CI +7.8% .. +12.3% over 3 rounds"
    assert not needs_more(ORIGINAL, [1100.0, 1120.0, 1080.0])


def test_worse() -> None:
    verdict = judge(ORIGINAL, [900.0, 915.0, 890.0])
    assert verdict.verdict == "worse" and verdict.change.high < 0
    assert not needs_more(ORIGINAL, [900.0, 915.0, 890.0])


def test_no_measurable_effect_is_resolved_when_the_interval_is_inside_the_resolution() -> None:
    b = [1003.0, 1008.0, 995.0]  # within +-0.5% of A in every round
    verdict = judge(ORIGINAL, b)
    assert verdict.verdict == "no measurable effect"
    assert -RESOLUTION < verdict.change.low < 0 < verdict.change.high < RESOLUTION
    assert verdict.change.resolved and "smaller than 3%" in verdict.reason
    assert not needs_more(ORIGINAL, b)


def test_noisy_arms_need_more_rounds_then_say_unresolved() -> None:
    b = [1060.0, 960.0, 1000.0]  # +6%, -5%, +1%: the interval straddles both zero and +-3%
    assert needs_more(ORIGINAL, b)
    verdict = judge(ORIGINAL, b)
    assert verdict.verdict == "no measurable effect" and not verdict.change.resolved
    assert "too noisy to resolve a 3% change" in verdict.reason and "--max-repeats" in verdict.reason
    # More rounds of the same arm, as steady as the first ones were noisy, settle it.
    more_a, more_b = ORIGINAL + [1000.0] * 5, [*b, 1001.0, 999.0, 1000.0, 1002.0, 998.0]
    assert not needs_more(more_a, more_b)
    assert judge(more_a, more_b).change.resolved


def test_a_failed_run_of_the_recommended_arm_fails_the_recommendation() -> None:
    verdict = judge(ORIGINAL, [1200.0, None, 1210.0])
    assert verdict.verdict == "failed"
    assert verdict.reason.startswith("1 of 3 runs of the recommended arm failed")
    assert verdict.recommended.failed == 1 and verdict.change is not None  # the completed pairs still shown
    assert not needs_more(ORIGINAL, [1200.0, None, 1210.0])
    assert judge(ORIGINAL, [None, None, None]).change is None


def test_failed_original_runs_lose_their_rounds() -> None:
    a = [None, 1000.0, None]
    verdict = judge(a, [1100.0, 1100.0, 1100.0])
    assert verdict.verdict == "inconclusive"
    assert "the original arm failed in 2 of 3 rounds" in verdict.reason
    assert needs_more(a, [1100.0, 1100.0, 1100.0])
    # A fourth round with both arms complete gives a second pair: a verdict again, with the loss noted.
    verdict = judge([*a, 1000.0], [1100.0, 1100.0, 1100.0, 1110.0])
    assert verdict.verdict == "confirmed" and verdict.change.pairs == 2
    assert "the original arm failed in 2 of 4 rounds" in verdict.reason


def test_arms_must_be_aligned_by_round() -> None:
    with pytest.raises(ValueError, match="aligned by round"):
        paired_change([1.0, 2.0], [1.0])
