"""``nonfinite``: a loss or gradient was not finite. Its levers make the step more stable (clipping, warm-up,
a lower learning rate, a safer precision); whether they avoid the fault shows only in a rerun.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding, costed, ranks_text
from diagnostics.analysis.load import RunTelemetry
from diagnostics.analysis.summary import RankPhases, Summary
from diagnostics.kinds.levers import Recommendation, lever, no_lever

STOPPED = "the run stopped: every step after it is lost until it is resumed with a change that avoids it"


SKIPPED = "the share of the run's steps whose update was dropped: their compute was spent for nothing"


UNKNOWN = "loss or gradients"  # run.json's list of skipped steps does not say which


SHOWN_EVENTS = 20  # a long run of skips lists its first steps only (the count stays exact)


# The guard's reason, as it writes it to run.json: "non-finite loss and gradients at step 4 (nan_policy=stop)"
REASON = re.compile(r"non-finite (?P<what>.+?) at step (?P<step>\d+)")


@dataclass(frozen=True)
class Event:
    """One bad step as the ranks recorded it."""

    step: int
    what: str  # loss | gradients | loss and gradients | UNKNOWN
    action: str  # skipped | stopped
    ranks: tuple[int, ...]  # the ranks that recorded it (all of them: the verdict is agreed)


def detect(run: RunTelemetry, summary: Summary, phases: list[RankPhases]) -> list[Finding]:
    """One ``nonfinite`` finding for a run with skipped steps or a non-finite stop; none otherwise."""
    events, source = _from_telemetry(run), "telemetry nonfinite records"
    if not events:
        events, source = _from_manifest(run), "run.json nonfinite"
    if not events:
        return []
    record = _manifest_record(run)
    stop = next((e for e in events if e.action == "stopped"), None)
    skipped = [e.step for e in events if e.action == "skipped"]
    recorded_by = sorted({r for e in events for r in e.ranks})
    world = run.world_size
    agreed = bool(recorded_by) and len(recorded_by) >= world
    steps_run = _steps_run(run, events)
    evidence: dict[str, Any] = {
        "policy": record.get("policy") or ("stop" if stop is not None and not skipped else "skip"),
        "action": "stopped" if stop is not None else "skipped",
        "stopped_at_step": stop.step if stop is not None else None,
        "what": stop.what if stop is not None else _common_what(events),
        "skipped_steps": skipped[:SHOWN_EVENTS],
        "skipped_total": len(skipped),
        "steps_run": steps_run,
        "recorded_by": recorded_by,
        "every_rank_agreed": agreed,
        "record": source,
    }
    if record.get("last_good_checkpoint") or stop is not None:
        evidence["last_good_checkpoint"] = record.get("last_good_checkpoint")
    who = (
        "every rank agreed (the ranks vote; which rank's values turned non-finite first is not recorded)"
        if agreed
        else f"recorded by {ranks_text(recorded_by)} of {world}"
        if recorded_by
        else "which ranks saw it is not recorded"
    )
    ranks = recorded_by or list(range(world))
    if stop is not None:
        return [_stopped(stop, skipped, evidence, who, ranks)]
    share = len(skipped) / steps_run if steps_run else 0.0
    listed = ", ".join(map(str, skipped[:SHOWN_EVENTS])) + (", ..." if len(skipped) > SHOWN_EVENTS else "")
    message = (
        f"{len(skipped)} of {steps_run} steps skipped with non-finite {evidence['what']} (step {listed}; "
        f"nan_policy=skip): their updates were dropped; {who}"
    )
    return [costed("nonfinite", ranks, evidence, message, share, SKIPPED, metric=share)]


def _stopped(stop: Event, skipped: list[int], evidence: dict[str, Any], who: str, ranks: list[int]) -> Finding:
    after = f" after {len(skipped)} skipped step(s)" if skipped else ""
    last = evidence.get("last_good_checkpoint")
    kept = f"; last good checkpoint: {last}" if last else ""
    message = f"non-finite {stop.what} at step {stop.step}{after}: the run stopped; {who}{kept}"
    return Finding(
        "nonfinite", "critical", ranks, evidence, message, metric=1.0, cost={"fraction": 1.0, "basis": STOPPED}
    )


def _from_telemetry(run: RunTelemetry) -> list[Event]:
    """The ranks' records merged by step: one event per bad step, with the ranks that recorded it."""
    by_step: dict[int, dict[str, Any]] = {}
    for rank, tele in sorted(run.ranks.items()):
        for rec in tele.nonfinite:
            step = rec.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                continue
            seen = by_step.setdefault(step, {"what": [], "action": [], "ranks": []})
            seen["what"].append(str(rec.get("what") or UNKNOWN))
            seen["action"].append("stopped" if rec.get("action") == "stopped" else "skipped")
            seen["ranks"].append(rank)
    return [
        Event(
            step,
            # Ranks agree by construction; if a record disagrees, every value is shown rather than one chosen.
            " / ".join(dict.fromkeys(seen["what"])),
            "stopped" if "stopped" in seen["action"] else "skipped",
            tuple(sorted(set(seen["ranks"]))),
        )
        for step, seen in sorted(by_step.items())
    ]


def _manifest_record(run: RunTelemetry) -> dict[str, Any]:
    record = run.manifest.nonfinite if run.manifest is not None else None
    return record if isinstance(record, dict) else {}


def _from_manifest(run: RunTelemetry) -> list[Event]:
    """The events run.json's record holds (no ranks: it is the launcher's summary, written once)."""
    record = _manifest_record(run)
    steps = record.get("skipped_steps")
    events = [Event(s, UNKNOWN, "skipped", ()) for s in steps if isinstance(s, int)] if isinstance(steps, list) else []
    stopped_at = record.get("stopped_at_step")
    if isinstance(stopped_at, int) and not isinstance(stopped_at, bool):
        match = REASON.search(str(record.get("stop_reason") or ""))
        events.append(Event(stopped_at, match["what"] if match else UNKNOWN, "stopped", ()))
    return events


def _common_what(events: list[Event]) -> str:
    kinds = list(dict.fromkeys(e.what for e in events))
    return kinds[0] if len(kinds) == 1 else " / ".join(kinds)


def _steps_run(run: RunTelemetry, events: list[Event]) -> int:
    """Optimizer steps the run took, skipped ones included: the most any source says."""
    counts = [max(e.step for e in events) + 1]
    result = run.manifest.result if run.manifest is not None else None
    steps = result.get("steps") if isinstance(result, dict) else getattr(result, "steps", None)
    if isinstance(steps, int) and not isinstance(steps, bool):
        counts.append(steps)
    for tele in run.ranks.values():
        if tele.steps:
            counts.append(tele.steps[-1].step)
        end = (tele.end or {}).get("steps")
        if isinstance(end, int) and not isinstance(end, bool):
            counts.append(end)
    return max(counts)


# Not measured: the usual remedies for a loss or gradients that turn NaN/inf, to try in this order.
TRIED_NOT_MEASURED = {"fraction": 0.0, "basis": "not measured: whether it avoids the non-finite step shows in a rerun"}


MIN_WARMUP_STEPS = 100  # a warm-up shorter than this rarely protects Adam's first, noisy moment estimates


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    ev = finding.evidence
    stopped = ev.get("action") == "stopped"
    recs = _stability_levers(ctx, ev)
    if stopped and ev.get("policy") == "stop":
        why = (
            "drop the update of a rare bad step and go on (up to trainer.max_nan_skips of them) instead of stopping; "
            "it hides nothing: each skip is recorded and reported. Only for rare spikes: a diverging run skips until "
            "it stops anyway"
        )
        recs.append(lever("trainer.nan_policy", "skip", why, "the run rides over an isolated non-finite step"))
    last = ev.get("last_good_checkpoint")
    if stopped and last:
        path = Path(str(last))
        # The run dir resumes from its newest complete checkpoint, which is the last good one (none is written for
        # the bad step); a checkpoint outside a run's checkpoints/ is resumed from directly.
        target = path.parent.parent if path.parent.name == "checkpoints" else path
        why = (
            f"continues from the last good checkpoint ({path.name}) with any of the changes above that a resume takes "
            "(trainer.grad_clip, trainer.nan_policy, optimizer.warmup_steps); the base lr comes from the "
            "checkpoint's schedule, so a lower optimizer.lr needs a fresh run"
        )
        recs.append(lever("resume", str(target), why, "the steps before the bad one are kept"))
    elif stopped:
        recs.append(no_lever("no checkpoint was saved before the bad step: rerun with a change above", "-"))
    return [replace(r, ab_testable=False).gaining(TRIED_NOT_MEASURED) if r.key else r for r in recs]


def _stability_levers(ctx: RunContext, ev: dict[str, Any]) -> list[Recommendation]:
    """Lower lr, longer warm-up, clipping, a safer precision: each only where the run's config leaves room."""
    lr, warmup, clip = ctx.get("optimizer.lr"), ctx.get("optimizer.warmup_steps"), ctx.get("trainer.grad_clip")
    step = ev.get("stopped_at_step")
    if step is None and ev.get("skipped_steps"):
        step = ev["skipped_steps"][0]
    levers: list[Recommendation] = []
    if isinstance(lr, int | float) and not isinstance(lr, bool) and lr > 0:
        why = (
            "a learning rate too high for this model and batch is the most common cause of a loss that diverges to "
            f"NaN; half of {lr:g}"
        )
        levers.append(lever("optimizer.lr", float(f"{lr / 2:.3g}"), why, "smaller updates, slower early progress"))
    if isinstance(warmup, int) and not isinstance(warmup, bool):
        longer = max(2 * warmup, MIN_WARMUP_STEPS)
        at = (
            f" (the bad step, {step}, came {'during' if isinstance(step, int) and step < warmup else 'after'} it)"
            if isinstance(step, int)
            else ""
        )
        why = (
            f"a longer warm-up, {longer} steps instead of {warmup}{at}, keeps early updates small while Adam's moment "
            "estimates settle"
        )
        levers.append(lever("optimizer.warmup_steps", longer, why, "a gentler start; the peak lr is reached later"))
    if isinstance(clip, int | float) and not isinstance(clip, bool) and clip <= 0:
        why = "gradient clipping is off (trainer.grad_clip=0): one large gradient can push the weights to inf"
        levers.append(lever("trainer.grad_clip", 1.0, why, "every update's norm bounded by 1.0"))
    return levers + _safer_precision(ctx)


def _safer_precision(ctx: RunContext) -> list[Recommendation]:
    precision = ctx.get("precision.name")
    if precision == "fp16-mixed":
        why = "fp16 overflows above 65504; bf16 has fp32's exponent range (overflow only above ~3e38)"
        return [lever("precision", "bf16-mixed", why, "no fp16 overflow; same speed on GPUs with bf16")]
    if precision == "bf16-true":
        why = "bf16-true keeps the weights and optimizer states in bf16; bf16-mixed keeps fp32 master weights"
        return [lever("precision", "bf16-mixed", why, "fp32 weight updates; more memory for the fp32 copies")]
    if precision == "bf16-mixed":
        why = "rules reduced precision out as the cause: fp32 throughout"
        return [lever("precision", "fp32", why, "slower steps and more activation memory; a diagnosis, not a fix")]
    return []
