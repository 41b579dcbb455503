"""What a tune shows and keeps: the live console table (one row per A/B, printed once) and
``tune/summary.{md,json}``."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from diagnostics.files import write_text_atomic

SUMMARY_DIR = "tune"
COLUMNS = ("round", "finding", "override", "expected", "measured (95% CI)", "verdict", "kept", "speed-up")
WIDTHS = (5, 16, 36, 8, 26, 20, 4, 8)


@dataclass(frozen=True)
class Row:
    round: int
    finding: str
    override: str
    lever: str
    expected_change: float | None  # tokens/s change the report predicted
    change: float | None  # measured
    ci: tuple[float, float] | None
    pairs: int
    verdict: str
    kept: bool
    reason: str
    loss_gap: float | None
    cumulative: float  # tokens/s of the best config over the starting one, after this round
    set_dir: str
    resolved: bool = False  # the interval excludes zero or a RESOLUTION change (diagnostics.ab.stats)
    retry: bool = False  # the one retry, with more rounds, of the previous row's unsettled A/B


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _cells(row: Row) -> tuple[str, ...]:
    measured = _pct(row.change) + (f" ({_pct(row.ci[0])}..{_pct(row.ci[1])})" if row.ci else "")
    return (
        str(row.round),
        row.finding,
        row.override,
        _pct(row.expected_change),
        measured,
        row.verdict,
        "yes" if row.kept else "no",
        f"x{row.cumulative:.3f}",
    )


def _line(cells: tuple[str, ...]) -> str:
    return "  ".join(c.ljust(w) if len(c) <= w else c[: w - 1] + "~" for c, w in zip(cells, WIDTHS, strict=True))


def table_header() -> str:
    return _line(COLUMNS)


def table_row(row: Row) -> str:
    return _line(_cells(row))


@dataclass
class TuneSummary:
    tune_dir: Path
    start: list[str]  # the user's overrides
    settings: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    final: list[str] = field(default_factory=list)
    stop: str = ""
    no_lever: list[dict[str, Any]] = field(default_factory=list)  # costly findings without a config lever
    skipped: list[dict[str, Any]] = field(default_factory=list)  # levers that change the math, not allowed
    inconclusive: list[dict[str, Any]] = field(default_factory=list)  # levers dropped unsettled (finding, why)
    start_tokens_per_s: float | None = None  # in rate_label's unit
    rate_label: str = "tokens/s"  # the runs' unit: a LightningModule's runs count samples
    wall_s: float = 0.0
    experiment: str | None = None  # the experiment file, relative to tune_dir
    error: str | None = None

    @property
    def speedup(self) -> float:
        return self.rows[-1].cumulative if self.rows else 1.0

    @property
    def command(self) -> str:
        return "python -m train " + shlex.join(self.final) if self.final else "python -m train"

    def changes(self) -> list[str]:
        return [r.override for r in self.rows if r.kept]

    def to_json(self) -> dict[str, Any]:
        return {
            "tune_dir": str(self.tune_dir),
            "settings": self.settings,
            "start_overrides": self.start,
            "start_tokens_per_s": self.start_tokens_per_s,
            "rate_label": self.rate_label,
            "final_overrides": self.final,
            "command": self.command,
            "experiment": self.experiment,
            "kept": self.changes(),
            "speedup": self.speedup,
            "stop_reason": self.stop,
            "error": self.error,
            "rounds": [asdict(r) for r in self.rows],
            "no_lever": self.no_lever,
            "skipped": self.skipped,
            "inconclusive": self.inconclusive,
            "wall_s": round(self.wall_s, 1),
        }

    def closing_lines(self) -> list[str]:
        lines = [f"tune: stopped: {self.stop}"]
        if self.error:
            lines.append(f"tune: {self.error}")
        lines += [f"tune: no config lever: {n['finding']} on rank(s) {n['ranks']}: {n['why']}" for n in self.no_lever]
        lines += [f"tune: not tried: {s['override']} ({s['finding']}): {s['reason']}" for s in self.skipped]
        lines += [f"tune: dropped: {d['override']} ({d['finding']}): {d['reason']}" for d in self.inconclusive]
        if self.changes():
            kept = ", ".join(self.changes())
            gain = f"x{self.speedup:.3f} {self.rate_label}"
            lines.append(f"tune: kept {kept}: {gain} over the starting config (measured)")
        else:
            lines.append("tune: no change kept: the starting config stays")
        lines.append(f"tune: reproduce: {self.command}")
        if self.experiment:
            lines.append(
                f"tune: or copy {self.tune_dir / self.experiment} to conf/experiment/<name>.yaml and run "
                "python -m train experiment=<name>"
            )
        lines.append(f"tune: summary {self.tune_dir / SUMMARY_DIR / 'summary.md'} (also summary.json)")
        return lines

    def to_markdown(self) -> str:
        lines = [
            f"# Tune: {self.tune_dir}",
            "",
            f"Started from `python -m train {shlex.join(self.start)}`"
            + (f" ({self.start_tokens_per_s:,.0f} {self.rate_label})." if self.start_tokens_per_s else "."),
            f"Stopped: {self.stop}. Wall time {self.wall_s / 60:.1f} min. Measured speed-up x{self.speedup:.3f}.",
            "",
            f"Final: `{self.command}`",
            "",
            "| " + " | ".join(COLUMNS) + " | decision |",
            "|" + "---|" * (len(COLUMNS) + 1),
        ]
        for row in self.rows:
            cells = [*_cells(row), row.reason]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        if self.no_lever:
            lines += ["", "## Findings without a config lever (nothing changed for them)", ""]
            lines += [f"- {n['finding']} on rank(s) {n['ranks']}: {n['why']}" for n in self.no_lever]
        if self.inconclusive:
            lines += ["", "## Levers dropped unsettled (neither confirmed nor ruled out)", ""]
            lines += [f"- `{d['override']}` ({d['finding']}): {d['reason']}" for d in self.inconclusive]
        if self.skipped:
            lines += ["", "## Levers not tried: they change the training math", ""]
            lines += [f"- `{s['override']}` ({s['finding']}): {s['reason']}" for s in self.skipped]
        if self.error:
            lines += ["", f"Error: {self.error}"]
        return "\n".join(lines) + "\n"

    def write(self) -> Path:
        out = self.tune_dir / SUMMARY_DIR
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "summary.json", json.dumps(self.to_json(), indent=2) + "\n")
        write_text_atomic(out / "summary.md", self.to_markdown())
        return out
