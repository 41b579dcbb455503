"""Bottleneck report of a run: ``RUN_DIR/report/report.{md,html,json}`` from the telemetry alone.

Called at the end of training (``diagnose_run``) and by ``python -m diagnose RUN_DIR``; both produce the same
report because both read only the run directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from diagnostics.ab.verdict import verdicts_by_override
from diagnostics.diagnosis import analyse
from diagnostics.files import write_text_atomic
from diagnostics.recommend import ab_tests, recommend_all
from diagnostics.report.html import to_html
from diagnostics.report.markdown import to_markdown
from diagnostics.report.model import Report

REPORT_DIR = "report"
AB_TOP_K = 3


def build_report(run_dir: Path) -> Report:
    """Analyse ``run_dir``'s telemetry and attach recommendations (FileNotFoundError without telemetry)."""
    analysis = analyse(Path(run_dir))
    return Report(Path(run_dir), analysis, recommend_all(analysis), verdicts=verdicts_by_override(Path(run_dir)))


def ab_lines(report: Report, top_k: int = AB_TOP_K) -> str:
    """The A/B multirun command lines of the report's top recommendations ('' if none has an override)."""
    tests = ab_tests(report.analysis, report.recommendations, top_k)
    if not tests:
        return ""
    measured = f"# measured, with repeats and a verdict: python -m diagnose {report.run_dir} --ab --run"
    return "\n".join([measured, "# or by hand, one Hydra multirun per recommendation:", *(t.shell() for t in tests)])


def write_report(report: Report, run_dir: Path | None = None) -> Path:
    """Write report.md, report.html and report.json under ``RUN_DIR/report/``; returns that directory."""
    out = Path(run_dir or report.run_dir) / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    ab = ab_lines(report)
    write_text_atomic(out / "report.json", json.dumps(report.to_json(), indent=2, default=str) + "\n")
    write_text_atomic(out / "report.md", to_markdown(report, ab))
    write_text_atomic(out / "report.html", to_html(report, ab))
    report.written_to = out
    return out


def diagnose_run(run_dir: Path) -> Report:
    """Build and write the report of ``run_dir``; print ``report.text_summary()`` to show it."""
    report = build_report(run_dir)
    write_report(report)
    return report


__all__ = ["Report", "ab_lines", "build_report", "diagnose_run", "write_report"]
