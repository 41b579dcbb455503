"""Pure analysis of a run directory's telemetry: load it, summarize it, measure what the finding kinds
(diagnostics/kinds) judge; diagnostics/diagnosis.py runs them.

No torch, no Lightning, no GPU: ``python -m diagnose`` runs this on a laptop over a copied run directory.
"""

from __future__ import annotations

from diagnostics.analysis.finding import KINDS, SEVERITIES, Finding
from diagnostics.analysis.load import RunTelemetry, load_run
from diagnostics.analysis.summary import RankPhases, Summary

__all__ = ["KINDS", "SEVERITIES", "Finding", "RankPhases", "RunTelemetry", "Summary", "load_run"]
