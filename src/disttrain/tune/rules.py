"""The decisions of a tune, as pure functions: which levers to try in which order, whether to keep a tested one,
when to stop, and how many A/B rounds the budget still pays for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from diagnostics.analysis.context import RunContext
from diagnostics.diagnosis import Analysis
from diagnostics.kinds.levers import Recommendation
from diagnostics.recommend import AbTest, ab_test
from disttrain.tune.levers import MATH_CHANGING, Lever, classify, global_pin, key_of

ARMS = 2  # the current best and one candidate per A/B


@dataclass(frozen=True)
class Candidate:
    """A recommendation tune can A/B: its finding, its lever class and the arms that test it."""

    finding: str
    finding_cost: float
    override: str
    lever: Lever
    expected_gain: float  # share of the step the report expects it to save
    test: AbTest


@dataclass(frozen=True)
class Skipped:
    """A costly finding's recommendation tune did not try, and why (no lever, or it changes the training math)."""

    finding: str
    ranks: tuple[int, ...]
    override: str  # empty: no config lever
    reason: str


def _gain(rec: Recommendation) -> float:
    value = rec.expected_gain.get("fraction")
    return float(value) if isinstance(value, int | float) else 0.0


def candidates(
    analysis: Analysis,
    recommendations: list[list[Recommendation]],
    original: list[str],
    allow: Iterable[str],
    min_cost: float,
    tried: Iterable[str] = (),
) -> tuple[list[Candidate], list[Skipped]]:
    """The levers of every finding that costs ``min_cost`` of the step or more, best expected gain first (ties: the
    report's order), without those already ``tried`` (by override); and what was left out, with why."""
    ctx = RunContext.from_run(analysis.run)
    allowed, done = set(allow), set(tried)
    feedback = ctx.get("strategy.powersgd_error_feedback") is not False
    found: list[tuple[float, int, Candidate]] = []
    skipped: list[Skipped] = []
    for finding, recs in zip(analysis.findings, recommendations, strict=False):
        if finding.cost_fraction < min_cost:
            continue
        ranks = tuple(finding.ranks)
        has_lever = any(rec.key is not None for rec in recs)
        for rec in recs:
            if rec.key is None or rec.value is None:
                if not has_lever:  # an explanation beside a lever is advice on top, not the lack of one
                    skipped.append(Skipped(finding.kind, ranks, "", rec.why))
                continue
            if not rec.ab_testable or rec.override in done:
                continue
            lever = classify(rec.key, rec.value, rec.pinned, ctx.global_batch(), feedback)
            if not lever.preserves_math and lever.name not in allowed:
                opens = f"; tune.allow=[{lever.name}] tries it" if lever.name in MATH_CHANGING else ""
                reason = lever.why + opens
                skipped.append(Skipped(finding.kind, ranks, rec.override, reason))
                continue
            test = ab_test(rec, ctx, original, analysis.run.run_dir)
            if test is None:
                continue
            if pin := global_pin(lever, test.recommended, ctx.global_batch()):
                test = replace(test, recommended=(*test.recommended, pin))
            test = replace(test, finding=finding.kind)
            candidate = Candidate(finding.kind, finding.cost_fraction, rec.override, lever, _gain(rec), test)
            found.append((-candidate.expected_gain, len(found), candidate))
    return [c for _, _, c in sorted(found, key=lambda x: x[:2])], skipped


def retarget(candidate: Candidate, current: list[str]) -> Candidate:
    """``candidate`` A/B-tested against ``current`` instead of the config it was found on: the lever's own overrides
    (those its recommended arm adds) replace whatever ``current`` sets for the same keys (or, for a group option,
    inside that group)."""
    test = candidate.test
    lever = [o for o in test.recommended if o not in test.original]
    keys = {key_of(o) for o in lever}
    groups = {k for k in keys if "." not in k}  # a new group option (strategy=fsdp) drops the old one's keys too

    def replaced(override: str) -> bool:
        key = key_of(override)
        return key in keys or key.split(".", 1)[0] in groups

    recommended = (*(o for o in current if not replaced(o)), *lever)
    return replace(candidate, test=replace(test, original=tuple(current), recommended=recommended))


def carried_over(found: list[Candidate], earlier: list[Candidate], tried: Iterable[str]) -> list[Candidate]:
    """Untested candidates of earlier diagnoses after this diagnosis's own: one short run's finding near the cost
    threshold can drop below it after an unrelated change, and a lever worth testing then is worth testing still."""
    seen = set(tried) | {c.override for c in found}
    kept = []
    for candidate in earlier:
        if candidate.override not in seen:
            seen.add(candidate.override)
            kept.append(candidate)
    return kept


def loss_gap(pairs: Iterable[tuple[dict[int, float], dict[int, float]]]) -> float | None:
    """The largest relative difference |B - A| / |A| between the losses of paired runs over the steps both logged;
    None when no pair has a step in common (then the math cannot be checked)."""
    gaps = [
        abs(new[step] - base[step]) / max(abs(base[step]), 1e-12)
        for base, new in pairs
        for step in base.keys() & new.keys()
    ]
    return max(gaps) if gaps else None


@dataclass(frozen=True)
class Decision:
    keep: bool
    reason: str


def decide(verdict: str, lever: Lever, gap: float | None, tolerance: float) -> Decision:
    """Keep a tested lever only if the A/B confirmed it and, when it is meant to keep the training math, the losses
    over the same steps stayed within ``tolerance`` of the current best's."""
    if verdict != "confirmed":
        return Decision(False, f"not kept: {verdict}")
    shown = "n/a" if gap is None else f"{gap:.2%}"
    if not lever.preserves_math:
        return Decision(True, f"kept: confirmed; changes the training math by design (tune.allow), loss gap {shown}")
    if gap is None:
        return Decision(False, "not kept: confirmed, but no loss logged at a step both arms share to check the math")
    if gap > tolerance:
        return Decision(False, f"not kept: confirmed, but losses differ by {shown} (> tolerance {tolerance:.2%})")
    return Decision(True, f"kept: confirmed, losses within {shown} (tolerance {tolerance:.2%})")


def repeats_that_fit(remaining_s: float, run_s: float, repeats: int, max_repeats: int) -> int:
    """A/B rounds (each one run of both arms) the remaining budget pays for, capped at ``max_repeats``; 0 when fewer
    than ``repeats`` fit (a test that cannot reach its minimum rounds is not started)."""
    if run_s <= 0:
        return max_repeats
    fit = math.floor(remaining_s / (ARMS * run_s))
    return min(max_repeats, fit) if fit >= repeats else 0


def unsettled(verdict: str, resolved: bool) -> bool:
    """Whether an A/B settled nothing: fewer than two complete pairs, or an interval that straddles zero and is too
    wide to exclude a RESOLUTION change either way (``resolved``). A narrow interval around zero is an answer (no
    effect worth having); a wide one is noise, and more rounds may still find the effect."""
    return verdict == "inconclusive" or (verdict == "no measurable effect" and not resolved)


def retry_rounds(rounds: int, remaining_s: float, run_s: float) -> tuple[int, int] | None:
    """(minimum, maximum) rounds of the one retry of an unsettled A/B that had ``rounds`` rounds: more than it had,
    up to twice as many, no more than the budget pays for; None when the budget cannot pay for more than it had
    (the lever is then dropped as inconclusive)."""
    most = repeats_that_fit(remaining_s, run_s, rounds + 1, 2 * max(rounds, 1))
    return (rounds + 1, most) if most else None


def inconclusive_reason(pairs: int, ci: tuple[float, float] | None, why: str) -> str:
    """Why an unsettled lever is dropped: every round it had (a retry's included), its last interval, and ``why``
    it gets no more (retried once already, or no budget or A/B test left for a retry)."""
    interval = f" (last 95% CI {ci[0]:+.1%}..{ci[1]:+.1%})" if ci else ""
    return f"not kept: inconclusive after {pairs} rounds{interval}; {why}"


def stop_reason(
    costly: int, candidates_left: int, rounds_done: int, max_rounds: int, rounds_fit: int, min_cost: float
) -> str | None:
    """Why the tune ends now (None: test the next candidate). ``costly``: findings costing ``min_cost`` or more."""
    if costly == 0:
        return f"no finding costs {min_cost:.0%} of the step or more"
    if candidates_left == 0:
        return "no config lever left for the costly findings"
    if rounds_done >= max_rounds:
        return f"tune.max_rounds={max_rounds} A/B tests done"
    if rounds_fit == 0:
        return "the budget left cannot pay for another A/B (tune.budget_min)"
    return None
