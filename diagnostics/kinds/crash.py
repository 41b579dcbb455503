"""``crash``: a rank died. The recommendation names the rank, its error and where to resume from."""

from __future__ import annotations

import dataclasses
from typing import Any

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding
from diagnostics.analysis.load import RunTelemetry
from diagnostics.analysis.summary import RankPhases, Summary
from diagnostics.crash import describe_site, primary_crash, raised_at
from diagnostics.kinds.levers import Recommendation, no_lever
from diagnostics.manifest import RunManifest

# A run that crashed: its other findings rest on the steps before the crash. With fewer steps than this on a
# rank (after warm-up, typically only a start-up window and at most one profiler window) they are reported as
# info only; with more, at most as warnings: the crash is the thing to fix, the rest is measured on a run
# that did not finish.
CRASHED_RUN_MIN_STEPS = 10
# The thresholds above, by name, for the report (report.json's ``thresholds``).
THRESHOLDS = {"CRASHED_RUN_MIN_STEPS": CRASHED_RUN_MIN_STEPS}


LOST = "the run stopped: every step after it is lost until it is fixed and resumed"


def detect(run: RunTelemetry, summary: Summary, phases: list[RankPhases]) -> list[Finding]:
    """One critical ``crash`` finding naming the rank whose error stopped the run; none for a run that did not."""
    echoes = sorted(rank for rank, record in run.crashes.items() if record.get("peer_failure"))
    cause = primary_crash(run.crashes)
    if cause is not None:
        return [_from_record(run, cause, echoes)]
    manifest = run.manifest
    # A run the hang watchdog ended (hung_ranks set) is the hang detector's finding, not a crash.
    if (
        manifest is not None
        and manifest.status == "failed"
        and manifest.failed_rank is not None
        and manifest.hung_ranks is None
    ):
        return [_from_manifest(manifest, manifest.failed_rank, echoes)]
    if echoes:  # every rank that wrote a record saw only a peer vanish: the one that failed left none
        first = run.crashes[echoes[0]]
        evidence = {"peer_failures": echoes, "seen": first.get("error"), "step": first.get("step")}
        message = (
            f"ranks {echoes} lost a peer ({first.get('error')}); the rank that failed first left no record "
            "(killed by a signal or the out-of-memory killer?)"
        )
        return [_finding(echoes, evidence, message)]
    return []


def _from_record(run: RunTelemetry, record: dict[str, Any], echoes: list[int]) -> Finding:
    rank = record["rank"]
    site = describe_site(record.get("step"), record.get("phase"))
    evidence = {
        "rank": rank,
        "exception": record.get("exception"),
        "message": record.get("message"),
        "step": record.get("step"),
        "phase": record.get("phase"),
        "raised_at": raised_at(str(record.get("traceback") or "")),
        "record": f"failure_rank{rank}.json",
        "peer_failures": echoes,  # ranks whose own error only says this one went away
        "steps_recorded": len(run.ranks[rank].steps) if rank in run.ranks else None,
    }
    message = f"rank {rank} raised " + (f"{site}: " if site else "") + f"{record.get('error')}; the run stopped"
    return _finding([rank], evidence, message)


def _from_manifest(manifest: RunManifest, rank: int, echoes: list[int]) -> Finding:
    evidence = {"rank": rank, "failure": manifest.failure, "record": "run.json", "peer_failures": echoes}
    evidence |= {"exception": manifest.exception, "step": manifest.step, "phase": manifest.phase}
    return _finding([rank], evidence, f"{manifest.failure or f'rank {rank} failed'}; the run stopped")


def _finding(ranks: list[int], evidence: dict[str, Any], message: str) -> Finding:
    return Finding("crash", "critical", ranks, evidence, message, metric=1.0, cost={"fraction": 1.0, "basis": LOST})


def temper_after_crash(findings: list[Finding], run: RunTelemetry) -> list[Finding]:
    """Other findings of a crashed run, graded no higher than the steps before the crash support (thresholds)."""
    counts = [len(tele.steps) for tele in run.ranks.values()]
    ceiling = "info" if not counts or min(counts) < CRASHED_RUN_MIN_STEPS else "warning"
    tempered = []
    for finding in findings:
        if finding.severity == "critical" or (finding.severity == "warning" and ceiling == "info"):
            evidence = {**finding.evidence, "graded_before_crash": finding.severity}
            finding = dataclasses.replace(finding, severity=ceiling, evidence=evidence)
        tempered.append(finding)
    return tempered


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
