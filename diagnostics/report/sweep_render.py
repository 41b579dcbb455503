"""The sweep report as Markdown and as one self-contained HTML page (inline CSS and SVG, no scripts), and the
three files ``SWEEP_DIR/report/sweep.{json,md,html}``."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from diagnostics.files import write_text_atomic
from diagnostics.prediction import compare
from diagnostics.report.fmt import GIB, gib, pct, rate
from diagnostics.report.html import CSS
from diagnostics.report.svg import Series, scatter, stacked_bars
from diagnostics.report.sweep import SWEEP_REPORT_DIR, SweepReport, SweepRun

HEADER = ["#", "run", "overrides", "status", "final loss", "tokens/s", "MFU", "peak memory", "planner error"]
HEADER += ["top bottleneck"]


def header(report: SweepReport) -> list[str]:
    """The runs table's columns, the rate in the runs' own unit."""
    return [report.rate_label if name == "tokens/s" else name for name in HEADER]


# The predicted-vs-measured errors a sweep shows per run (``diagnostics.prediction``), with short names.
PLANNER_ERRORS = {"step_time_s": "step", "comm_s": "comm", "memory_bytes": "memory", "state_bytes": "state"}


def _planner(run: SweepRun) -> str:
    errors = compare((run.prediction or {}).get("predicted") or {}, (run.prediction or {}).get("measured") or {})
    shown = [f"{name} {errors[key]:+.0%}" for key, name in PLANNER_ERRORS.items() if key in errors]
    return ", ".join(shown) or "n/a"


def _loss(run: SweepRun) -> str:
    if run.final_loss is None:
        return "n/a"
    return f"{run.final_loss:.4f} ({'val' if run.val_loss is not None else 'train'})"


def _mfu(run: SweepRun) -> str:
    return "n/a" if run.mfu is None else f"{pct(run.mfu)} ({run.mfu_basis})"


def _status(run: SweepRun) -> str:
    status = run.status
    if run.status == "pruned" and run.pruned_at_step is not None:
        status = f"pruned at step {run.pruned_at_step}"
    return status + (f", {run.attempts} attempts" if run.attempts > 1 else "")


def run_rows(report: SweepReport) -> list[list[str]]:
    rows = []
    for i, run in enumerate(report.runs, start=1):
        memory = gib(run.peak_memory_bytes) + (f" {run.peak_memory_kind}" if run.peak_memory_kind else "")
        rows.append([
            str(i), run.name, report.label(run), _status(run), _loss(run), rate(run.tokens_per_s), _mfu(run),
            memory if run.peak_memory_bytes else "n/a", _planner(run),
            run.top_finding or ("none" if run.has_report else "no report"),
        ])  # fmt: skip
    return rows


def scaling_rows(report: SweepReport) -> list[list[str]]:
    rows = []
    for series in report.scaling:
        for p in series.points:
            rows.append([p.run, str(p.world_size), rate(p.tokens_per_s), f"{p.speedup:.2f}x", pct(p.efficiency)])
    return rows


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def to_markdown(report: SweepReport) -> str:
    parts = [f"# Sweep report: {report.sweep_dir}", "", report.text_summary().split("\n")[0], ""]
    varying = ", ".join(report.varying) or "nothing (a single run, or identical overrides)"
    parts += [f"Varied: {varying}. Ranked by final loss (validation if measured, else training).", ""]
    parts += ["## Runs", "", _md_table(header(report), run_rows(report)), ""]
    parts += [f"## Pareto front: {report.rate_label} vs peak memory", ""]
    parts += [", ".join(report.pareto) or f"no completed run recorded both {report.rate_label} and peak memory", ""]
    if report.scaling:
        parts += ["## Scaling efficiency (runs that differ only in world size)", ""]
        parts += [_md_table(["run", "world size", "tokens/s", "speedup", "efficiency"], scaling_rows(report)), ""]
    if report.study is not None:
        parts += ["## Optuna study", "", study_line(report), ""]
        screened = [r for r in report.runs if r.status == "screened"]
        if screened:
            parts += ["### Screened out (predicted not to fit; never launched)", ""]
            parts += [f"- {run.name}: `{report.label(run)}`: {run.error}" for run in screened] + [""]
    if report.failed:
        parts += ["## Failed runs", ""]
        for run in report.failed:
            parts += [f"### {run.name}: {report.label(run)}", "", f"**{run.error}**", ""]
            if run.error_detail:
                parts += ["```", run.error_detail, "```", ""]
    return "\n".join(parts)


def study_line(report: SweepReport) -> str:
    study = report.study
    assert study is not None
    states = ", ".join(f"{n} {state}" for state, n in sorted(study.states.items()))
    line = f"Study '{study.name}' ({study.direction}) in {study.storage}: {states or 'no trials'}."
    if study.best is not None:
        line += f" Best: trial {study.best['number']} (job {study.best['job']}), {study.best['value']:.4f}."
    return line


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def _table(header: list[str], rows: list[list[str]], row_class: list[str] | None = None) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join(
        f'<tr class="{_e(row_class[i]) if row_class else ""}">' + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>"
        for i, row in enumerate(rows)
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def plots(report: SweepReport) -> list[tuple[str, str, str | None]]:
    done = [r for r in report.runs if r.status == "completed"]
    points = [
        (r.name, r.peak_memory_bytes / GIB, r.tokens_per_s) for r in done if r.tokens_per_s and r.peak_memory_bytes
    ]
    label = report.rate_label
    front = scatter("pareto", f"{label.capitalize()} vs peak memory", "peak memory GiB", label, points, report.pareto)
    losses = [r for r in done if r.final_loss is not None]
    loss_bars = stacked_bars(
        "final-loss", "Final loss per run", "nats/token", [r.name for r in losses],
        [Series("final loss", [r.final_loss or 0.0 for r in losses])],
    )  # fmt: skip
    pareto_caption = "Each completed run; the Pareto front (no other run is faster with less memory) joined"
    return [
        ("pareto", pareto_caption, front if points else None),
        ("final-loss", "Final loss of each completed run, in rank order", loss_bars if losses else None),
    ]


def to_html(report: SweepReport) -> str:
    figures = []
    for plot_id, caption, svg in plots(report):
        inner = svg if svg is not None else f'<p class="no-data" data-plot="{_e(plot_id)}">nothing recorded</p>'
        figures.append(f"<figure>{inner}<figcaption>{_e(caption)}</figcaption></figure>")
    sections = [
        f"<h1>Sweep report: {_e(report.sweep_dir)}</h1>",
        f"<p>{_e(report.text_summary().splitlines()[0])}. Varied: <code>{_e(', '.join(report.varying) or 'nothing')}"
        "</code>. Ranked by final loss (validation if measured, else training).</p>",
        "<h2>Runs</h2>",
        _table(header(report), run_rows(report), [r.status for r in report.runs]),
        f"<h2>Pareto front: {report.rate_label} vs peak memory</h2>",
        f"<p>{_e(', '.join(report.pareto) or 'no completed run recorded both tokens/s and peak memory')}</p>",
        '<div class="plots">' + "\n".join(figures) + "</div>",
    ]
    if report.scaling:
        sections += [
            "<h2>Scaling efficiency (runs that differ only in world size)</h2>",
            _table(["run", "world size", "tokens/s", "speedup", "efficiency"], scaling_rows(report)),
        ]
    if report.study is not None:
        sections += ["<h2>Optuna study</h2>", f"<p>{_e(study_line(report))}</p>"]
        screened = [r for r in report.runs if r.status == "screened"]
        if screened:
            sections.append("<h3>Screened out (predicted not to fit; never launched)</h3><ul>")
            sections += [f"<li>{_e(r.name)}: <code>{_e(report.label(r))}</code>: {_e(r.error)}</li>" for r in screened]
            sections.append("</ul>")
    if report.failed:
        sections.append("<h2>Failed runs</h2>")
        for run in report.failed:
            detail = f"<pre>{_e(run.error_detail)}</pre>" if run.error_detail else ""
            sections.append(
                f'<div class="finding critical" data-run="{_e(run.name)}"><strong>{_e(run.name)}</strong> '
                f"<code>{_e(report.label(run))}</code><p>{_e(run.error)}</p>{detail}</div>"
            )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e('sweep: ' + str(report.sweep_dir))}</title><style>{CSS}"
        " tr.failed td { background: #fdecea; }</style></head>\n<body>\n" + "\n".join(sections) + "\n</body></html>\n"
    )


def write_sweep_report(report: SweepReport) -> Path:
    """``SWEEP_DIR/report/sweep.{json,md,html}`` (each written then renamed, like the run report); returns that
    directory."""
    out = report.sweep_dir / SWEEP_REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    report.written_to = out
    write_text_atomic(out / "sweep.json", json.dumps(report.to_json(), indent=2, default=str) + "\n")
    write_text_atomic(out / "sweep.md", to_markdown(report))
    write_text_atomic(out / "sweep.html", to_html(report))
    return out
