"""``hang``: ranks stopped making progress. No config lever: the recommendation names where each rank's stack was."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding, cost, ranks_text
from diagnostics.analysis.load import RunTelemetry
from diagnostics.analysis.summary import RankPhases, Summary
from diagnostics.kinds.levers import Recommendation, no_lever


def _in_collective(run: RunTelemetry) -> dict[int, bool]:
    """Which ranks the watchdog saw inside a collective (dict or per-rank list in one record, or a flag each)."""
    out: dict[int, bool] = {}
    for rank, tele in run.ranks.items():
        value = (tele.hang or {}).get("in_collective")
        if isinstance(value, bool):
            out[rank] = value
        elif isinstance(value, dict):
            out.update({int(k): bool(v) for k, v in value.items() if str(k).lstrip("-").isdigit()})
        elif isinstance(value, list) and all(isinstance(v, bool) for v in value):
            out.update(dict(enumerate(value)))
        elif isinstance(value, list):  # a list of the ranks that are in a collective
            inside = {v for v in value if isinstance(v, int)}
            out.update({r: r in inside for r in range(run.world_size)})
    return out


def _waiting_on_loader(records: Iterable[dict[str, Any]]) -> dict[int, list[str]]:
    """rank -> where each of its DataLoader workers is, for the ranks whose main thread waited for a batch."""
    out: dict[int, list[str]] = {}
    for record in records:
        value = record.get("waiting_on_loader")
        if isinstance(value, dict):
            for rank, frames in value.items():
                if str(rank).isdigit() and isinstance(frames, list):
                    out[int(rank)] = [str(f) for f in frames]
    return out


def detect(run: RunTelemetry, summary: Summary, phases: list[RankPhases]) -> list[Finding]:
    hung = {r: t.hang for r, t in run.ranks.items() if t.hang}
    if not hung:
        return []
    last_step = {
        r: (t.hang or {}).get("last_step", t.steps[-1].step if t.steps else None) for r, t in run.ranks.items()
    }
    inside = _in_collective(run)
    outside = sorted(r for r, v in inside.items() if not v)
    steps = [s for s in last_step.values() if isinstance(s, int)]
    behind = sorted(r for r, s in last_step.items() if isinstance(s, int) and steps and s < max(steps))
    missing = sorted(set(range(run.world_size)) - set(run.ranks))
    named = outside or behind or missing or sorted(hung)
    first = next(iter(hung.values()))
    stacks = first.get("stacks_dir")
    if isinstance(stacks, str) and stacks and not stacks.startswith("/"):
        stacks = str(run.run_dir / stacks)  # the watchdog writes it relative to the run dir
    evidence = {
        "last_step": last_step,
        "in_collective": inside,
        "timeout_s": first.get("timeout_s"),
        "stacks_dir": stacks,
        "ranks_reporting_hang": sorted(hung),
        "ranks_without_telemetry": missing,
        "ranks_finished": sorted(r for r, t in run.ranks.items() if t.end),
    }
    on_loader = _waiting_on_loader(hung.values())
    if on_loader:
        evidence["waiting_on_loader"] = on_loader
    why = "not inside a collective" if outside else "behind the others" if behind else "hung"
    loader = "".join(
        f"; rank {rank} waits for its DataLoader workers"
        + (f" ({'; '.join(frames)}): a worker stuck in its dataset or collate, or deadlocked" if frames else "")
        for rank, frames in sorted(on_loader.items())
    )
    message = (
        f"no step completed within {first.get('timeout_s', '?')} s; {ranks_text(named)} {why} — the others wait "
        f"for {'it' if len(named) == 1 else 'them'}{loader}; stacks in {stacks or 'RUN_DIR/hang/'}"
    )
    lost = cost(1.0, "no step completes: the run is lost")
    return [Finding("hang", "critical", named, evidence, message, None, lost)]


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    why = (
        f"read the Python stacks of ranks {finding.ranks} in {finding.evidence.get('stacks_dir') or 'RUN_DIR/hang/'}:"
        " a rank outside the collective the others wait in is usually a rank-dependent branch, an exception "
        "swallowed on one rank, or a deadlocked data loader"
    )
    return [no_lever(why, "the job completes").gaining({"fraction": 1.0, "basis": "the run completes"})]
