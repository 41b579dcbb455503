"""The advice ledger: every A/B-tested recommendation, its expected gain beside what was measured, in one file.

``python -m diagnose RUN --ab --run`` and ``python -m tune`` append one line per tested recommendation to
``<output root>/advice_ledger.jsonl``; ``python -m diagnose advice [DIR]`` reads it back and says, per finding
kind, how the report's expected gains compare with the measured changes. The output root is the directory that
holds the dated run dirs (``outputs/`` for ``outputs/<date>/<time>``), so every run of a project shares one
ledger. Plain JSON lines, appended under an exclusive lock: two A/Bs ending at once both land.
"""

from __future__ import annotations

import fcntl
import json
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diagnostics.analysis.context import RunContext
from diagnostics.diagnosis import Analysis

LEDGER = "advice_ledger.jsonl"
DATE_DIR = re.compile(r"^\d{4}-\d{2}-\d{2}$")  # Hydra's default ``outputs/<date>/<time>`` run dirs
SCHEMA_VERSION = 1


def output_root(run_dir: Path) -> Path:
    """Where the ledger of ``run_dir`` lives: the parent of the run's date dir (``outputs/`` for
    ``outputs/2026-11-27/08-17-43`` and anything below it), else the run dir's parent. Never a search upwards for
    an existing ledger: a stray one in /tmp or $HOME would collect every unrelated run below it."""
    path = Path(run_dir).resolve()
    for parent in [path, *path.parents]:
        if DATE_DIR.match(parent.name):
            return parent.parent
    return path.parent


def context_json(analysis: Analysis) -> dict[str, Any]:
    """What the advice was given for: strategy, precision, hardware and world size of the analysed run."""
    ctx = RunContext.from_run(analysis.run)
    return {
        "strategy": ctx.strategy,
        "precision": ctx.get("precision.name"),
        "hw": ctx.get("hw.name"),
        "device": analysis.run.meta("device"),
        "world_size": analysis.run.world_size,
        "cpu_count": ctx.cpu_count,
    }


def entry(
    tested: dict[str, Any],
    finding: str | None,
    context: dict[str, Any],
    source: str,
    run_dir: Path,
    finding_cost: float | None = None,
) -> dict[str, Any]:
    """One ledger line from one recommendation of a verdict (``diagnostics.ab.verdict`` JSON)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "t": time.time(),
        "source": source,
        "run_dir": str(run_dir),
        "finding": finding,
        "finding_cost": finding_cost,
        "override": tested.get("override"),
        "expected_change": tested.get("expected_change"),
        "measured_change": tested.get("change"),
        "ci": tested.get("ci"),
        "pairs": tested.get("pairs"),
        "verdict": tested.get("verdict"),
        "context": context,
    }


def append(root: Path, entries: list[dict[str, Any]]) -> Path:
    """Append ``entries`` to ``root``'s ledger (created if absent); returns its path."""
    path = Path(root) / LEDGER
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as out:
        fcntl.flock(out, fcntl.LOCK_EX)  # one writer at a time: lines never interleave
        out.write("".join(json.dumps(e) + "\n" for e in entries))
    return path


def read(path: Path) -> list[dict[str, Any]]:
    """The ledger's entries; a line that is not a JSON object (a write cut short) is skipped."""
    entries = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            entries.append(value)
    return entries


def find_ledger(directory: Path) -> Path | None:
    """The ledger for ``directory``: its own, or that of the output root it belongs to."""
    own = Path(directory) / LEDGER
    if own.is_file():
        return own
    root = output_root(directory) / LEDGER
    return root if root.is_file() else None


@dataclass(frozen=True)
class KindScore:
    """How one finding kind's expected gains compared with the measured changes."""

    finding: str
    tests: int
    confirmed: int
    scored: int  # tests with both an expected and a measured change
    median_expected: float | None
    median_measured: float | None
    median_abs_error: float | None  # |measured - expected|, tokens/s change
    median_error: float | None  # measured - expected: < 0 means the advice promised too much


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def score_by_kind(entries: list[dict[str, Any]]) -> list[KindScore]:
    """Per finding kind (most-tested first): verdict counts and the expected vs measured change."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        kinds.setdefault(str(e.get("finding") or "unknown"), []).append(e)
    scores = []
    for kind, group in kinds.items():
        pairs = [
            (float(e["expected_change"]), float(e["measured_change"]))
            for e in group
            if isinstance(e.get("expected_change"), int | float) and isinstance(e.get("measured_change"), int | float)
        ]
        measured = [float(e["measured_change"]) for e in group if isinstance(e.get("measured_change"), int | float)]
        scores.append(
            KindScore(
                kind,
                len(group),
                sum(e.get("verdict") == "confirmed" for e in group),
                len(pairs),
                _median([x for x, _ in pairs]),
                _median(measured),
                _median([abs(m - x) for x, m in pairs]),
                _median([m - x for x, m in pairs]),
            )
        )
    return sorted(scores, key=lambda s: (-s.tests, s.finding))


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def advice_text(entries: list[dict[str, Any]], path: Path) -> str:
    """The console table of ``python -m diagnose advice``."""
    lines = [
        f"advice ledger {path}: {len(entries)} tested recommendation(s); change: tokens/s, by interleaved A/B",
        f"  {'finding':<16} {'tests':>5} {'confirmed':>9} {'expected':>9} {'measured':>9} {'|error|':>8} {'bias':>8}",
    ]
    for s in score_by_kind(entries):
        error = "n/a" if s.median_abs_error is None else f"{100 * s.median_abs_error:.1f}pt"
        bias = "n/a" if s.median_error is None else f"{100 * s.median_error:+.1f}pt"
        lines.append(
            f"  {s.finding:<16} {s.tests:>5} {s.confirmed:>9} {_pct(s.median_expected):>9} "
            f"{_pct(s.median_measured):>9} {error:>8} {bias:>8}"
        )
    lines.append(
        "  medians per kind; |error| = |measured - expected| over the tests that carry both, bias < 0: the advice "
        "promised more than it delivered"
    )
    return "\n".join(lines)
