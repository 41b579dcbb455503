"""What the steps' records measure for several finding kinds at once: each rank's phase shares, the communication
the ranks expose (profiled, or timed at the collectives), and the samples taken while training.
"""

from __future__ import annotations

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.load import RankTelemetry, RunTelemetry, Sample
from diagnostics.analysis.stats import present, ratio, steady
from diagnostics.analysis.summary import RankPhases
from diagnostics.analysis.thresholds import MIN_PHASE_S


def phase_fractions(phases: list[RankPhases], key: str) -> dict[int, float]:
    """Per rank, mean ``key`` over mean step time, for ranks where the phase is above timer noise."""
    out = {}
    for p in phases:
        value = getattr(p, key)
        if value is not None and value >= MIN_PHASE_S and (f := ratio(value, p.step_s)) is not None:
            out[p.rank] = f
    return out


def collective_comm_s(phases: list[RankPhases]) -> float | None:
    """Profiled collective communication per step that every rank pays: the minimum over the ranks' windows.

    A gloo/NCCL collective event on a rank lasts from its call until the last rank has joined and the data has
    moved: the rank that arrives last measures the transfer, every earlier one adds its wait for that rank.
    With one 3-step window per rank, that wait is whatever scheduling noise those steps had (on the README's
    default run: 41 ms on rank 0, 61 ms on rank 1, of the same all-reduce), so only the minimum is the
    communication itself. Where the step records timed the phases' collectives call by call, each rank's measured
    wait inside them (``collective_wait_s``, analysis/phase_comm) comes off first.
    """
    values = [
        max(0.0, p.profile_comm_s - (p.collective_wait_s or 0.0)) * p.profile_collective_share
        for p in phases
        if p.profile_comm_s is not None
    ]
    return min(values) if values else None


def profile_exposed(p: RankPhases, comm_s: float | None) -> float | None:
    """Share of a rank's profiled step in which the collective communication ``comm_s`` was not hidden."""
    if comm_s is None or p.profile_total_s is None or p.profile_comm_s is None:
        return None
    hidden = ratio(p.profile_overlap_s or 0.0, p.profile_comm_s) or 0.0
    return ratio(comm_s * (1.0 - hidden), p.profile_total_s)


def step_transfers(run: RunTelemetry) -> list[tuple[float, float]]:
    """Per steady step that every rank recorded: (minimum comm wait over the ranks, the slowest rank's step)."""
    by_step: dict[int, list[tuple[float, float]]] = {}
    for tele in run.ranks.values():
        for s in steady(tele.steps):
            if s.comm_wait_s is not None and s.step_s:
                by_step.setdefault(s.step, []).append((s.comm_wait_s, s.step_s))
    world = len(run.ranks)
    rows = [pairs for pairs in by_step.values() if len(pairs) == world and world > 1]
    out = [(min(w for w, _ in pairs), max(t for _, t in pairs)) for pairs in rows]
    if RunContext.from_run(run).strategy == "ddp":  # its comm hook times every bucket: a small wait is a small one
        return out
    # No wait at all: FSDP2's gradients bypass the hook that separates it, so the step timer could not see it.
    return out if out and sum(w for w, _ in out) / len(out) >= MIN_PHASE_S else []


def step_transfer_fraction(run: RunTelemetry) -> float | None:
    """Whole-run exposed communication from the step records: per step, the minimum comm wait over the ranks.

    A rank's comm wait is the transfer plus its wait for the last rank to finish backward. On the README's
    default run (2 CPU ranks) the ranks' mean comm waits were 6.5% of the step while the per-step minimum was
    2.5%: the rest was whichever rank the scheduler happened to slow in that step, a different one each time.
    """
    rows = step_transfers(run)
    return ratio(sum(w for w, _ in rows), sum(t for _, t in rows)) if rows else None


def exposed_comm(
    run: RunTelemetry, phases: list[RankPhases]
) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """Per rank: exposed communication from the whole-run step records, from the profile, and the larger.

    The step records time DDP's wait after each rank's own backward over every step; the profile sees FSDP's
    waits inside backward, which the step timer counts as compute, but only over one window.
    """
    comm_s = collective_comm_s(phases)
    transfer = step_transfer_fraction(run)
    steps = {p.rank: transfer for p in phases if transfer is not None and p.comm_wait_s is not None}
    profile = {p.rank: f for p in phases if (f := profile_exposed(p, comm_s)) is not None}
    exposed = {r: max(steps.get(r, 0.0), profile.get(r, 0.0)) for r in set(steps) | set(profile)}
    return steps, profile, exposed


def training_samples(tele: RankTelemetry) -> list[Sample]:
    """The rank's samples taken while it ran its steady steps (all of them where steps carry no start time)."""
    steps = [s for s in steady(tele.steps) if s.start_t and s.step_s is not None]
    if not steps:
        return tele.samples
    first, last = steps[0].start_t or 0.0, max((s.start_t or 0.0) + (s.step_s or 0.0) for s in steps)
    inside = [s for s in tele.samples if first <= s.t <= last]
    return inside or tele.samples


def unexplained_idle(p: RankPhases) -> float | None:
    """Profiler idle time that neither the data wait nor the wait at a collective explains, per step.

    A loader running in the training process and DDP's end-of-backward wait both leave the profiled thread
    without ops (idle) while being data and communication problems, which their own detectors report.
    """
    if p.profile_idle_s is None or p.profile_total_s is None:
        return None
    return ratio(max(0.0, p.profile_idle_s - (p.data_wait_s or 0.0) - (p.comm_wait_s or 0.0)), p.profile_total_s)


def device_idle(phases: list[RankPhases]) -> float | None:
    """The smallest share of a profiled step any rank's device spent with no kernel running, beyond its data and
    communication waits: what every rank pays for a host that does not keep its device fed (None: no profile)."""
    return min(present(unexplained_idle(p) for p in phases), default=None)
