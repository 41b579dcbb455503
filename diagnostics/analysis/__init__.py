"""Pure analysis of a run directory's telemetry: load it, summarize it, find what limits the run.

No torch, no Lightning, no GPU: ``python -m diagnose`` runs this on a laptop over a copied run directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from diagnostics.analysis.finding import KINDS, SEVERITIES, Finding
from diagnostics.analysis.findings import find_all
from diagnostics.analysis.load import RunTelemetry, load_run
from diagnostics.analysis.shares import step_shares
from diagnostics.analysis.summary import RankPhases, Summary, summarize
from diagnostics.analysis.tail import slow_tail


@dataclass
class Analysis:
    run: RunTelemetry
    summary: Summary
    phases: list[RankPhases]
    findings: list[Finding]


def analyse(run_dir: Path) -> Analysis:
    """Load ``run_dir``'s telemetry and run every detector (FileNotFoundError if it has no telemetry)."""
    run = load_run(Path(run_dir))
    summary, phases = summarize(run)
    summary.step_shares = step_shares(run, phases)
    findings = find_all(run, summary, phases)
    summary.tail = slow_tail(summary.step_time, findings)
    return Analysis(run, summary, phases, findings)


__all__ = ["KINDS", "SEVERITIES", "Analysis", "Finding", "RankPhases", "RunTelemetry", "Summary", "analyse", "load_run"]
