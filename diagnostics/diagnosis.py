"""A run's diagnosis: its telemetry loaded and summarized, every finding kind's detector run over it, and what they
found reconciled and ordered, most limiting first."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from diagnostics.analysis.finding import Finding
from diagnostics.analysis.load import RunTelemetry, load_run
from diagnostics.analysis.shared_cores import bound_by_idle_cores
from diagnostics.analysis.shares import step_shares
from diagnostics.analysis.summary import RankPhases, Summary, summarize
from diagnostics.analysis.tail import slow_tail
from diagnostics.kinds import ORDER
from diagnostics.kinds.crash import temper_after_crash
from diagnostics.kinds.registry import REGISTRY

# The kinds whose findings join the others' after these are one per cause, each at its step of ``find_all``; every
# other kind's findings are first reduced to one per cause (``one_per_cause``).
JOINING_LATER = ("low_mfu", "pauses", "expert_imbalance", "nonfinite", "crash")


def one_per_cause(findings: list[Finding]) -> list[Finding]:
    """One finding per kind and ranks: where two detectors saw the same cause (a rank's loader stalling now and then
    is both an intermittent stall and a data wait), the one graded higher, the one with a stall pattern on a tie."""
    best: dict[tuple[str, tuple[int, ...]], Finding] = {}
    for f in findings:
        key = (f.kind, tuple(f.ranks))
        held = best.get(key)
        if held is None or (f.sort_key()[0], "pattern" not in f.evidence) < (
            held.sort_key()[0],
            "pattern" not in held.evidence,
        ):
            best[key] = f
    return [f for f in findings if best[(f.kind, tuple(f.ranks))] is f]


def explained_by_experts(findings: list[Finding], experts: list[Finding]) -> list[Finding]:
    """``findings`` with ``experts`` added, less a straggler that is the rank holding the hot experts: its extra
    expert work is what makes it slow, and expert_imbalance says so with levers (the straggler has none; the run
    behind this rule: benchmarks/RESULTS.md, "Expert placement explains the straggler")."""
    hot = {rank for f in experts for rank in f.ranks}
    kept = [f for f in findings if not (f.kind == "straggler" and f.ranks and set(f.ranks) <= hot)]
    dropped = [f for f in findings if f not in kept]
    if dropped:
        experts = [
            replace(f, evidence={**f.evidence, "explains_straggler": round(dropped[0].cost_fraction, 4)})
            for f in experts
        ]
    return kept + experts


def find_all(run: RunTelemetry, summary: Summary, phases: list[RankPhases]) -> list[Finding]:
    """All findings, the biggest lever first (cost descending; see ``Finding.sort_key``). A crash or a non-finite
    stop comes first, and the other findings of a run that ended early are graded on the little it measured."""
    found = {name: kind.detect(run, summary, phases) for name, kind in REGISTRY.items()}
    findings = one_per_cause([f for name in ORDER if name not in JOINING_LATER for f in found[name]])
    if any(f.kind == "comm_bound" for f in findings):
        # On a host whose compute threads fill every core, low_overlap has no lever (nothing to overlap with) and
        # would cost comm_bound's exposed communication a second time; with free cores it offers its own (overlap).
        findings = [f for f in findings if not (f.kind == "low_overlap" and f.evidence.get("host_cores_busy"))]
    findings += found["low_mfu"] + found["pauses"]
    findings = explained_by_experts(findings, found["expert_imbalance"])
    findings = bound_by_idle_cores(findings, run)
    stopped = [f for f in found["nonfinite"] if f.evidence.get("action") == "stopped"]
    ended = found["crash"] + stopped
    if ended:
        findings = temper_after_crash(findings, run)
    # Skipped steps are counted exactly, not estimated from the few steps measured: never tempered.
    skipped = [f for f in found["nonfinite"] if f not in stopped]
    return sorted(ended + skipped + findings, key=Finding.sort_key)


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
