"""What a fix can gain on a CPU host whose ranks share its cores: at most the cores the run left idle.

With more compute threads than cores (4 ranks on 2 cores), a rank that waits (for its batch, in a sleep, for a
peer) is not a core standing idle: the other ranks run on it meanwhile, and catch up on the work they would
otherwise queue for. Removing the wait then shortens the step only by the core time that really went unused. The
run's ranks record their CPU use (``cpu_util_pct`` samples): over its steady steps the host's cores were busy a
share ``b`` of the time. Without the fault the same CPU work needs at least ``b`` of the step, so no fix of a
wait can gain more than ``1 - b`` (plus the CPU work the fix removes: a slow rank's extra compute, a loader's work
on the training thread): without the bound, 4 ranks on 2 cores read each delay's cost at well above what
removing it gained (benchmarks/RESULTS.md, "Figures moved from the code").

A healthy run leaves cores idle too (all ranks inside the same collective), which the bound does not know; so the
cost is graded on ``(idle - c) / (1 - c)``, with ``c`` the share of the step even the last rank to arrive spends in
collectives (more than the natural idle: gloo's collectives use CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import pairwise

from diagnostics.analysis.finding import Finding, severity_of
from diagnostics.analysis.load import RunTelemetry, StepRecord
from diagnostics.analysis.stats import median, steady

# Findings whose fix removes waiting, not CPU work: their gain is bounded by the idle cores (host_overhead's and
# the communication findings' fixes remove CPU work of their own, which the samples do not separate).
BOUNDED_KINDS = ("straggler", "input_bound", "pipeline_bubble", "expert_imbalance")
MIN_SAMPLES = 3  # per rank inside the steady window, below which the busy share is not read


@dataclass(frozen=True)
class HostCores:
    """One host's cores over a run's steady steps, where its ranks' threads outnumber them."""

    hostname: str
    ranks: list[int]
    cores: int
    busy_share: float  # of the host's core time, spent by the run's ranks (their samples' mean CPU use)
    cpu_pct: dict[int, float]  # rank -> its mean CPU use (percent of one core)
    collective_share: float  # the share of the step even the last rank spends inside collectives

    @property
    def idle_share(self) -> float:
        return max(0.0, 1.0 - self.busy_share)


def shared_hosts(run: RunTelemetry) -> dict[int, HostCores]:
    """Rank -> its host's cores, for CPU ranks on hosts with more compute threads than cores and enough samples."""
    hosts: dict[str, list[int]] = {}
    for rank, tele in run.ranks.items():
        meta = tele.meta or {}
        if meta.get("sampler") != "cpu" or not str(meta.get("device", "cpu")).startswith("cpu"):
            continue
        hosts.setdefault(str(meta.get("hostname") or ""), []).append(rank)
    out: dict[int, HostCores] = {}
    for hostname, ranks in hosts.items():
        host = _host(run, hostname, sorted(ranks))
        if host is not None:
            out.update(dict.fromkeys(host.ranks, host))
    return out


def _host(run: RunTelemetry, hostname: str, ranks: list[int]) -> HostCores | None:
    metas = [run.ranks[r].meta or {} for r in ranks]
    cores = metas[0].get("cpu_count")
    threads = [m.get("num_threads") for m in metas]
    if not isinstance(cores, int) or cores < 1 or not all(isinstance(t, int) and t >= 1 for t in threads):
        return None
    if sum(threads) <= cores:  # type: ignore[arg-type]
        return None  # a core per thread: a waiting rank's core has no one else to serve
    cpu_pct: dict[int, float] = {}
    collectives: list[float] = []
    for rank in ranks:
        steps = [s for s in steady(run.ranks[rank].steps) if s.start_t is not None and s.step_s]
        if not steps:
            return None
        start, end = steps[0].start_t or 0.0, max((s.start_t or 0.0) + (s.step_s or 0.0) for s in steps)
        used = _mean_cpu_pct(run, rank, start, end)
        if used is None:
            return None
        cpu_pct[rank] = used
        collectives.append(
            (median([_in_collectives(s) for s in steps]) or 0.0) / (median([s.step_s or 0.0 for s in steps]) or 1.0)
        )
    busy = min(1.0, sum(cpu_pct.values()) / (100.0 * cores))
    return HostCores(hostname, ranks, cores, busy, cpu_pct, min(collectives))


def _in_collectives(s: StepRecord) -> float:
    return sum(x or 0.0 for x in (s.comm_wait_s, s.forward_comm_s, s.backward_comm_s, s.optimizer_comm_s))


def _mean_cpu_pct(run: RunTelemetry, rank: int, start: float, end: float) -> float | None:
    """The rank's CPU use over [start, end], from the samples whose interval (since the previous one) lies in it,
    weighted by that interval."""
    samples = sorted(run.ranks[rank].samples, key=lambda s: s.t)
    weighted, seconds, n = 0.0, 0.0, 0
    for before, s in pairwise(samples):
        if s.cpu_util_pct is None or before.t < start or s.t > end:
            continue
        weighted += s.cpu_util_pct * (s.t - before.t)
        seconds += s.t - before.t
        n += 1
    return weighted / seconds if n >= MIN_SAMPLES and seconds > 0 else None


def _removed_cpu_share(finding: Finding, run: RunTelemetry, host: HostCores) -> float | None:
    """The host's core time the finding's fix would remove (not just move), as a share; None: not known."""
    if finding.kind == "straggler":
        others = [p for r, p in host.cpu_pct.items() if r not in finding.ranks]
        if not others:
            return None
        base = median(others) or 0.0
        return sum(max(0.0, host.cpu_pct[r] - base) for r in finding.ranks if r in host.cpu_pct) / (100 * host.cores)
    if finding.kind == "input_bound":
        # The loader's work on the training thread is the fix's to remove (workers, a faster pipeline).
        share = 0.0
        for rank in finding.ranks:
            steps = steady(run.ranks[rank].steps)
            cpu = [s.data_cpu_s for s in steps if s.data_cpu_s is not None]
            step_s = [s.step_s for s in steps if s.step_s]
            if not cpu or not step_s:
                return None  # an older collector: the wait may be the loader computing
            share += sum(cpu) / len(cpu) / (sum(step_s) / len(step_s)) / host.cores
        return share
    return 0.0  # re-balancing experts or filling a pipeline's bubble moves work, it does not remove it


def bound_by_idle_cores(findings: list[Finding], run: RunTelemetry) -> list[Finding]:
    """``findings`` with the costs of waiting bounded by the idle cores of the hosts their ranks share."""
    hosts = shared_hosts(run)
    if not hosts:
        return findings
    return [_bounded(f, run, hosts) if f.kind in BOUNDED_KINDS else f for f in findings]


def _bounded(finding: Finding, run: RunTelemetry, hosts: dict[int, HostCores]) -> Finding:
    if not finding.ranks or any(r not in hosts for r in finding.ranks):
        return finding
    bounds: list[tuple[float, float, HostCores]] = []
    for host in {hosts[r].hostname: hosts[r] for r in finding.ranks}.values():
        removed = _removed_cpu_share(finding, run, host)
        if removed is None:
            return finding
        natural = min(host.collective_share, host.idle_share)
        lower = max(0.0, (host.idle_share - natural) / (1.0 - natural)) + removed
        bounds.append((host.idle_share + removed, lower, host))
    bound, lower, host = max(bounds, key=lambda b: b[0])
    if finding.cost_fraction <= bound:
        return finding
    fraction = round(min(1.0, bound), 4)
    graded = min(fraction, lower, float(finding.evidence.get("cost_lower_bound", fraction)))
    evidence = {
        **finding.evidence,
        "shared_cores": {
            "host": host.hostname,
            "ranks": host.ranks,
            "cores": host.cores,
            "busy_share": round(host.busy_share, 4),
            "cost_before_bound": finding.cost_fraction,
        },
        "cost_lower_bound": round(graded, 4),
    }
    basis = (
        f"{finding.cost['basis']}; bounded by the {100 * host.idle_share:.0f}% of {host.hostname or 'the host'}'s "
        f"{host.cores} cores the run left idle ({len(host.ranks)} ranks share them: a rank's wait lends its core to "
        "the others)"
    )
    corroborated = finding.evidence.get("corroborated", True) is not False
    return replace(
        finding,
        severity=severity_of(graded, corroborated=corroborated),
        evidence=evidence,
        cost={"fraction": fraction, "basis": basis},
    )
