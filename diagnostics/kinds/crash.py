"""``crash``: a rank died. The recommendation names the rank, its error and where to resume from."""

from __future__ import annotations

from diagnostics.analysis import Finding
from diagnostics.analysis.context import RunContext
from diagnostics.kinds.levers import Recommendation, no_lever


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    ev = finding.evidence
    resume = "then resume=RUN_DIR continues from the newest complete checkpoint"
    if ev.get("exception") is None and ev.get("failure"):  # killed without a record of its own (run.json)
        why = (
            f"find out why rank {ev.get('rank')} ended ({ev['failure']}): the kernel's out-of-memory killer (dmesg), "
            f"the scheduler, or a crash below Python (its log, train_rank<N>.log); {resume}"
        )
        return [no_lever(why, "the run completes")]
    where = f" at {ev['raised_at']}" if ev.get("raised_at") else ""
    why = (
        f"fix the error rank {ev.get('rank')} raised{where} (its traceback: {ev.get('record') or 'RUN_DIR'}); {resume}"
    )
    return [no_lever(why, "the run completes")]
