"""report.md: the same content as the HTML, readable in a terminal or a pull request (no plots)."""

from __future__ import annotations

import json

from diagnostics.ab.runner import AB_DIR
from diagnostics.ab.verdict import VERDICT_MD, phrase
from diagnostics.analysis.tail import tail_line
from diagnostics.kinds.levers import Recommendation
from diagnostics.prediction import basis_text, comparison_rows
from diagnostics.report.fmt import cost_text, flops, gain_text, gib, pct, peak_memory, rank_label, rate, seconds
from diagnostics.report.model import Report

AB_VERDICT = f"{AB_DIR}/{VERDICT_MD}"
AB_LINK = f"../{AB_VERDICT}"  # the report lives in RUN/report/, the verdict in RUN/ab/


def tested_note(report: Report, rec: Recommendation) -> str:
    """`` A/B-tested: <verdict>`` for a recommendation that ``--ab --run`` measured, else ''."""
    tested = report.verdict_of(rec)
    return f" **A/B-tested: {phrase(tested)}** ({AB_VERDICT})" if tested else ""


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


def summary_rows(report: Report) -> list[list[object]]:
    s = report.analysis.summary
    label, peak = peak_memory(s.peak_memory)
    calibrated = flops(s.calibrated_peak_flops) if s.calibrated_peak_flops else "no calibration recorded"
    datasheet = "n/a: no datasheet peak for this hardware and dtype"
    if s.peak_flops:
        datasheet = f"{pct(s.mfu)} / {pct(s.hfu)} of {flops(s.peak_flops)} per device ({s.peak_flops_source})"
    loop = s.loop or {}
    paused: list[list[object]] = []
    if loop.get("paused_s"):
        kinds = ", ".join(f"{what} {v['count']}x {seconds(v['seconds'])}" for what, v in loop["by_what"].items())
        paused = [
            [
                f"{s.rate_label} with validation and checkpoints",
                f"{rate(loop.get('loop_tokens_per_s'))} ({pct(loop.get('share'))} of the loop's "
                f"{seconds(loop.get('loop_s'))} outside the steps: {kinds})",
            ]
        ]
    return [
        [s.rate_label, f"{rate(s.tokens_per_s)} ({s.tokens_per_s_source or 'n/a'})"],
        *paused,
        ["MFU / HFU", datasheet],
        ["calibrated MFU / HFU", f"{pct(s.calibrated_mfu)} / {pct(s.calibrated_hfu)} of {calibrated} per device"],
        ["step time p50 / p90 / p99", " / ".join(seconds(s.step_time.get(q)) for q in ("p50", "p90", "p99"))],
        [f"peak memory ({label})", gib(peak)],
        ["world size / device", f"{s.world_size} / {s.device}"],
        ["steps recorded", s.steps_recorded],
    ]


def phase_rows(report: Report) -> list[list[object]]:
    return [
        [
            p.rank,
            p.steps,
            *(
                seconds(getattr(p, k))
                for k in ("step_s", "data_wait_s", "forward_s", "backward_compute_s", "optimizer_s")
            ),
            *(seconds(getattr(p, k)) for k in ("local_compute_s", "comm_wait_s", "other_s")),
        ]
        for p in report.analysis.phases
    ]


PHASE_HEADER = ["rank", "steps", "step", "data wait", "forward", "backward compute", "optimizer", "local compute"]
PHASE_HEADER += ["comm wait", "other"]


def prediction_section(record: dict | None) -> list[str]:
    """The planner's prediction for this run's layout beside the measurement (``python -m plan`` numbers)."""
    if record is None:
        return []
    lines = ["", "## Predicted vs measured", ""]
    lines.append(f"Layout `{record.get('layout')}`; hw numbers: {basis_text(record)}.")
    if record.get("calibration"):
        lines.append(f"Calibration from `{record['calibration']}`.")
    if record.get("unpredicted"):
        lines.append(f"Step time not predicted: {record['unpredicted']}.")
    lines += ["", *_table(["quantity", "predicted", "measured", "error"], [list(r) for r in comparison_rows(record)])]
    return lines


def attempt_lines(attempts: list[dict]) -> list[str]:
    """One line listing each attempt's world when the run was restarted (an elastic restart changes it)."""
    if len(attempts) < 2:
        return []
    parts = [
        f"{a.get('attempt')}: world {a.get('world_size')} (global batch {a.get('global_batch')}, accumulation "
        f"{a.get('accumulation')})"
        for a in attempts
    ]
    return ["", f"attempts: {'; '.join(parts)}"]


def to_markdown(report: Report, ab_lines: str | None = None) -> str:
    ctx = report.context()
    lines = [
        f"# Diagnostics report: {report.run_dir}",
        "",
        f"strategy `{ctx['strategy']}`, precision `{ctx['precision']}`, hw `{ctx['hw']}`, model `{ctx['model']}`, "
        f"data `{ctx['data']}`, world size {ctx['world_size']}",
        *attempt_lines(ctx["attempts"]),
        "",
        "## Summary",
        "",
        *_table(["metric", "value"], summary_rows(report)),
    ]
    for err in report.analysis.summary.accounting_errors:
        lines += ["", f"**Accounting error:** {err}"]
    lines += ["", "## Findings", ""]
    if not report.findings:
        lines.append("No detector crossed its threshold.")
    if report.findings or report.analysis.summary.step_shares:
        lines += [f"**Verdict:** {report.verdict()}", ""]
        if (tail := tail_line(report.analysis.summary.tail)) is not None:
            lines += [f"**{tail[0].upper()}{tail[1:]}.**", ""]
    for finding, recs in zip(report.findings, report.recommendations, strict=True):
        lines += [
            f"### {finding.severity}: {finding.kind} ({rank_label(finding.ranks)}), costs {cost_text(finding)}",
            "",
            finding.message,
            "",
            f"Cost basis: {finding.cost.get('basis')}.",
            "",
            "```json",
            json.dumps(finding.evidence, indent=1, default=str),
            "```",
            "",
        ]
        for i, rec in enumerate([r for r in recs if r.override], 1):
            expected = f"Expected: {rec.expected_effect} ({gain_text(rec)})."
            lines.append(f"{i}. `{rec.override}`: {rec.why}. {expected}{tested_note(report, rec)}")
        lines += [f"Explanation: {rec.why}." for rec in recs if not rec.override]
        lines.append("")
    lines += ["## Per-rank phases (mean per steady step)", "", *_table(PHASE_HEADER, phase_rows(report))]
    lines += prediction_section(report.prediction)
    if report.verdicts:
        lines += ["", "## A/B verdicts", "", f"Measured by `python -m diagnose --ab --run`: [{AB_VERDICT}]({AB_LINK})"]
        lines += [f"- `{o}`: {phrase(v)}" for o, v in report.verdicts.items()]
    if ab_lines:
        lines += ["", "## A/B test the top recommendations", "", "```sh", ab_lines, "```"]
    if report.analysis.run.problems:
        lines += ["", "## Telemetry problems", "", *(f"- {p}" for p in report.analysis.run.problems)]
    return "\n".join(lines) + "\n"
