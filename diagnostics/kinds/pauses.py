"""``pauses``: validations and checkpoint writes take a large share of the loop's wall time. Its levers space them
out, each with the trade-off it brings (later feedback, more steps lost on a crash).
"""

from __future__ import annotations

import math
from dataclasses import replace

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding, costed, pct, severity_of
from diagnostics.analysis.load import RunTelemetry
from diagnostics.analysis.pauses import INTERVAL_KEYS, loop_time
from diagnostics.analysis.stats import rounded
from diagnostics.analysis.summary import RankPhases, Summary
from diagnostics.analysis.thresholds import COST_WARNING
from diagnostics.kinds.levers import Recommendation, gain, lever, no_lever

# pauses: validation and checkpoint writes are work the user asked for, not a fault; below the warning cost their
# share of the loop is the price of that. Reported from PAUSES_MIN_SHARE, but graded on what rarer intervals can give
# back: each kind is only made rarer down to PAUSE_TARGET_SHARE of the loop (a run validates and saves for a reason;
# under 2% a rarer one saves less than two identical runs differ). The README's default run (4 validations of 8
# batches and 2 saves in 220 steps) spends 4-5% of its loop there (5.06% on a CI box): info, since 2-3 points of
# that are all the levers could return.
PAUSES_MIN_SHARE = COST_WARNING
PAUSE_TARGET_SHARE = 0.02
# The thresholds above, by name, for the report (report.json's ``thresholds``).
THRESHOLDS = {"PAUSES_MIN_SHARE": PAUSES_MIN_SHARE, "PAUSE_TARGET_SHARE": PAUSE_TARGET_SHARE}


def detect(run: RunTelemetry, summary: Summary, phases: list[RankPhases]) -> list[Finding]:
    """``pauses``: validation and checkpoint writes take at least PAUSES_MIN_SHARE of the training loop's time.

    The cost is their whole share; the severity follows the part of it that rarer intervals can return, each kind
    brought down to PAUSE_TARGET_SHARE and no further (the validation and saving the run asked for stay)."""
    loop = loop_time(run)
    if loop is None or loop.share < PAUSES_MIN_SHARE:
        return []
    kept = sum(min(p.seconds / loop.loop_s, PAUSE_TARGET_SHARE) for p in loop.paused.values())
    reachable = max(0.0, loop.share - kept)
    parts = [
        f"{_what_text(what)} {p.count} times ({p.seconds / p.count:.2f} s each, {pct(p.seconds / loop.loop_s)})"
        for what, p in sorted(loop.paused.items(), key=lambda item: -item[1].seconds)
    ]
    message = (
        f"the training loop spends {pct(loop.share)} of its time outside training steps: {'; '.join(parts)} "
        f"in {loop.steps} steps"
    )
    evidence = {
        **loop.to_json(),
        "share_by_what": {w: rounded(p.seconds / loop.loop_s) for w, p in loop.paused.items()},
        "threshold_share": PAUSES_MIN_SHARE,
        "reachable_share": rounded(reachable),  # what the severity is graded on
        "source": "pause records (validation, checkpoint writes) within rank 0's first to last step",
    }
    basis = "validation and checkpoint seconds within the training loop (each pause's slowest rank) / the loop's time"
    finding = costed("pauses", sorted(run.ranks), evidence, message, loop.share, basis)
    return [replace(finding, severity=severity_of(reachable))]


def _what_text(what: str) -> str:
    return {"validation": "validation", "checkpoint": "checkpoint writes"}.get(what, what)


PAUSE_NAMES = {"validation": "validations", "checkpoint": "checkpoint writes"}


PAUSE_TRADE_OFFS = {
    "validation": "a validation loss every {n} steps instead of every {old}",
    "checkpoint": "a crash or preemption loses up to {n} steps of work instead of {old}",
}


def periodic_count(every: int, max_steps: int) -> int:
    """Pauses due before the last step (the one at the last step comes whatever the interval)."""
    return (max_steps - 1) // every if every > 0 else 0


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    """Each kind of pause made rarer, most costly first: its interval multiplied until its share is about
    PAUSE_TARGET_SHARE (but one still comes before the last step); the gain is the share of its pauses that no
    longer come in the run's steps."""
    shares = finding.evidence.get("share_by_what") or {}
    max_steps = ctx.get("trainer.max_steps")
    recs: list[Recommendation] = []
    for what, share in sorted(shares.items(), key=lambda item: -float(item[1] or 0.0)):
        key, share = INTERVAL_KEYS.get(what), float(share or 0.0)
        if share <= PAUSE_TARGET_SHARE:
            continue
        every = ctx.get(key) if key else None
        periodic = isinstance(every, int) and isinstance(max_steps, int) and periodic_count(every, max_steps) > 0
        if key is None or not isinstance(every, int) or not isinstance(max_steps, int) or not periodic:
            # Pauses no interval of the run's config makes periodic (a signal's checkpoints, a user callback's saves).
            shown = f"{key}={every}" if key and every is not None else "no interval in the run's config"
            recs.append(no_lever(f"{PAUSE_NAMES.get(what, what)} take {pct(share)} of the loop ({shown})", "-"))
            continue
        before = periodic_count(every, max_steps)
        # At most as rare as keeps one of them inside the run: a run validates or saves for a reason.
        factor = max(2, min(math.ceil(share / PAUSE_TARGET_SHARE), before))
        rarer, after = every * factor, periodic_count(every * factor, max_steps)
        saved = 1.0 - after / before
        why = (
            f"{PAUSE_NAMES.get(what, what)} take {pct(share)} of the training loop, every {every} steps; every "
            f"{rarer} steps they come {factor}x less often"
        )
        trade_off = PAUSE_TRADE_OFFS.get(what, "{n} steps apart instead of {old}").format(n=rarer, old=every)
        effect = f"{pct(share * saved)} less wall-clock time for the same steps; {trade_off}"
        basis = f"the {what} pauses that no longer come: {before} -> {after} in the run"
        rec = replace(lever(key, rarer, why, effect), metric="loop_tokens_per_s")
        recs.append(rec.gaining(gain(finding, share * saved / (finding.cost_fraction or 1.0), basis)))
    return recs
