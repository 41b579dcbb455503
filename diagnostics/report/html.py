"""report.html: one self-contained page (inline CSS and SVG, no scripts, no external URLs)."""

from __future__ import annotations

import json
from html import escape

from diagnostics.ab.verdict import phrase
from diagnostics.kinds.levers import Recommendation
from diagnostics.report.fmt import cost_text, gain_text, rank_label
from diagnostics.report.markdown import AB_VERDICT, PHASE_HEADER, phase_rows, summary_rows
from diagnostics.report.model import Report
from diagnostics.report.plots import all_plots

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1100px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0; } td, th { border: 1px solid #ddd; padding: 3px 8px; }
th { background: #f4f4f4; text-align: left; } code, pre { background: #f6f6f6; font-size: 12px; }
pre { padding: 8px; overflow-x: auto; white-space: pre-wrap; }
.finding { border-left: 5px solid #999; padding: 4px 12px; margin: 12px 0; background: #fafafa; }
.critical { border-color: #d62728; } .warning { border-color: #ff9f1a; } .info { border-color: #4e79a7; }
.sev { font-weight: 600; text-transform: uppercase; font-size: 12px; }
.plot-title { font-weight: 600; font-size: 14px; } .axis, .legend { font-size: 11px; fill: #444; }
.grid { stroke: #e5e5e5; } figcaption { color: #555; font-size: 12px; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 8px 20px; }
.plots figure { margin: 0; } svg.plot { width: 100%; height: auto; }
.no-data { color: #888; font-style: italic; } details { margin: 6px 0; }
"""


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def _table(header: list[str], rows: list[list[object]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _findings(report: Report) -> str:
    if not report.findings:
        return "<p>No detector crossed its threshold.</p>"
    parts = []
    for finding, recs in zip(report.findings, report.recommendations, strict=True):
        items = "".join(
            f"<li>{f'<code>{_e(r.override)}</code>: ' if r.override else ''}"
            f"{_e(r.why)}. <em>Expected:</em> {_e(r.expected_effect)} ({_e(gain_text(r))}).{_tested(report, r)}</li>"
            for r in recs
        )
        parts.append(
            f'<div class="finding {_e(finding.severity)}" data-kind="{_e(finding.kind)}">'
            f'<span class="sev">{_e(finding.severity)}</span> <strong>{_e(finding.kind)}</strong>'
            f" ({_e(rank_label(finding.ranks))}), costs <strong>{_e(cost_text(finding))}</strong>"
            f"<p>{_e(finding.message)}</p><p><em>Cost basis:</em> {_e(finding.cost.get('basis'))}</p><ol>{items}</ol>"
            f"<details><summary>evidence</summary><pre>{_e(json.dumps(finding.evidence, indent=1, default=str))}"
            "</pre></details></div>"
        )
    return "\n".join(parts)


def _tested(report: Report, rec: Recommendation) -> str:
    tested = report.verdict_of(rec)
    if tested is None:
        return ""
    verdict = _e(tested.get("verdict"))
    return f' <strong class="ab" data-verdict="{verdict}">A/B-tested: {_e(phrase(tested))}</strong>'


def _plots(report: Report) -> str:
    parts = []
    for plot_id, caption, svg in all_plots(report.analysis):
        inner = svg if svg is not None else f'<p class="no-data" data-plot="{_e(plot_id)}">nothing recorded</p>'
        parts.append(f"<figure>{inner}<figcaption>{_e(caption)}</figcaption></figure>")
    return '<div class="plots">' + "\n".join(parts) + "</div>"


def to_html(report: Report, ab_lines: str | None = None) -> str:
    ctx = report.context()
    accounting = report.analysis.summary.accounting_errors
    errors = "".join(f"<p><strong>Accounting error:</strong> {_e(e)}</p>" for e in accounting)
    problems = "".join(f"<li>{_e(p)}</li>" for p in report.analysis.run.problems)
    config_rows = [[k, v] for k, v in sorted(ctx["config"].items())]
    sections = [
        f"<h1>Diagnostics report: {_e(report.run_dir)}</h1>",
        f"<p>strategy <code>{_e(ctx['strategy'])}</code>, precision <code>{_e(ctx['precision'])}</code>, "
        f"hw <code>{_e(ctx['hw'])}</code>, model <code>{_e(ctx['model'])}</code>, data <code>{_e(ctx['data'])}</code>,"
        f" world size {_e(ctx['world_size'])}</p>",
        "<h2>Summary</h2>",
        _table(["metric", "value"], summary_rows(report)),
        errors,
        "<h2>Findings</h2>",
        f"<p><strong>Verdict:</strong> {_e(report.verdict())}</p>",
        _findings(report),
        "<h2>Plots</h2>",
        _plots(report),
        "<h2>Per-rank phases (mean per steady step)</h2>",
        _table(PHASE_HEADER, phase_rows(report)),
    ]
    if report.verdicts:
        items = "".join(f"<li><code>{_e(o)}</code>: {_e(phrase(v))}</li>" for o, v in report.verdicts.items())
        where = f"<code>{_e(AB_VERDICT)}</code> in the run dir"
        sections += ["<h2>A/B verdicts</h2>", f"<p>Measured by <code>python -m diagnose --ab --run</code>: {where}</p>"]
        sections.append(f"<ul>{items}</ul>")
    if ab_lines:
        sections += ["<h2>A/B test the top recommendations</h2>", f"<pre>{_e(ab_lines)}</pre>"]
    if problems:
        sections += ["<h2>Telemetry problems</h2>", f"<ul>{problems}</ul>"]
    overrides = " ".join(ctx["overrides"] or []) or "(none recorded)"
    sections += [
        "<h2>Configuration</h2>",
        f"<p>overrides: <code>{_e(overrides)}</code></p>",
        f"<details><summary>resolved config ({len(config_rows)} keys)</summary>{_table(['key', 'value'], config_rows)}"
        "</details>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e('diagnostics: ' + str(report.run_dir))}</title><style>{CSS}</style></head>\n<body>\n"
        + "\n".join(sections)
        + "\n</body></html>\n"
    )
