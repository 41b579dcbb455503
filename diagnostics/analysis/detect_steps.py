"""Detectors over step timing: input_bound, straggler, comm_bound, host_overhead, pipeline_bubble."""

from __future__ import annotations

from diagnostics.analysis.finding import Finding, grade, ranks_text
from diagnostics.analysis.load import RunTelemetry
from diagnostics.analysis.stats import mean, median, present, ratio, rounded, steady
from diagnostics.analysis.summary import RankPhases
from diagnostics.analysis.thresholds import (
    BUBBLE_CRITICAL_FRACTION,
    BUBBLE_FRACTION,
    COMM_BOUND_CRITICAL_FRACTION,
    COMM_BOUND_FRACTION,
    COMM_SATURATION,
    EXPLAINED_WAIT_FRACTION,
    HOST_OVERHEAD_CRITICAL_FRACTION,
    HOST_OVERHEAD_FRACTION,
    INPUT_BOUND_CRITICAL_FRACTION,
    INPUT_BOUND_FRACTION,
    LOW_DEVICE_UTIL_PCT,
    MIN_PHASE_S,
    STRAGGLER_CRITICAL_RATIO,
    STRAGGLER_PERSISTENCE,
    STRAGGLER_RATIO,
)


def _pct(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"


def _fractions(phases: list[RankPhases], key: str) -> dict[int, float]:
    """Per rank, mean ``key`` over mean step time, for ranks where the phase is above timer noise."""
    out = {}
    for p in phases:
        value = getattr(p, key)
        if value is not None and value >= MIN_PHASE_S and (f := ratio(value, p.step_s)) is not None:
            out[p.rank] = f
    return out


def detect_input_bound(run: RunTelemetry, phases: list[RankPhases]) -> list[Finding]:
    fractions = _fractions(phases, "data_wait_s")
    flagged = sorted(r for r, f in fractions.items() if f >= INPUT_BOUND_FRACTION)
    if not flagged:
        return []
    worst = max(fractions[r] for r in flagged)
    by_rank = {p.rank: p for p in phases}
    evidence = {
        "data_wait_fraction": {r: rounded(fractions[r]) for r in flagged},
        "data_wait_s": {r: rounded(by_rank[r].data_wait_s) for r in flagged},
        "step_s": {r: rounded(by_rank[r].step_s) for r in flagged},
        "threshold_fraction": INPUT_BOUND_FRACTION,
    }
    severity = grade(worst, INPUT_BOUND_FRACTION, INPUT_BOUND_CRITICAL_FRACTION) or "warning"
    message = (
        f"{ranks_text(flagged)} wait for the next batch {_pct(worst)} of each step "
        f"({by_rank[flagged[0]].data_wait_s:.3f} s of {by_rank[flagged[0]].step_s:.3f} s): the input pipeline "
        "cannot keep up"
    )
    return [Finding("input_bound", severity, flagged, evidence, message, worst)]


def local_compute_windows(run: RunTelemetry) -> tuple[list[list[float | None]], str]:
    """Per-rank local compute per window: rank 0's all-gathers, else the ranks' own step records per step."""
    if run.windows:
        return [w.local_compute_s for w in run.windows], "ranks all-gather"
    world = run.world_size
    by_step: dict[int, list[float | None]] = {}
    for rank, tele in run.ranks.items():
        for s in steady(tele.steps):
            if s.local_compute_s is not None and 0 <= rank < world:
                by_step.setdefault(s.step, [None] * world)[rank] = s.local_compute_s
    return [by_step[k] for k in sorted(by_step)], "per-rank step records"


def detect_straggler(run: RunTelemetry, phases: list[RankPhases]) -> list[Finding]:
    """A rank whose local compute (not step time: DDP equalizes that) is well above the other ranks'."""
    windows, source = local_compute_windows(run)
    windows = [w for w in windows if len(present(w)) >= 2]
    if not windows:
        return []
    num_ranks = max(len(w) for w in windows)
    slow_windows = [0] * num_ranks
    for w in windows:
        for rank, value in enumerate(w):
            others = median(v for i, v in enumerate(w) if i != rank)
            if value is not None and others and value >= STRAGGLER_RATIO * others and value - others >= MIN_PHASE_S:
                slow_windows[rank] += 1
    means = {r: mean(w[r] for w in windows if r < len(w)) for r in range(num_ranks)}
    ratios: dict[int, float] = {}
    for rank, value in means.items():
        others = median(v for r, v in means.items() if r != rank)
        if value is None or not others or slow_windows[rank] < STRAGGLER_PERSISTENCE * len(windows):
            continue
        if value >= STRAGGLER_RATIO * others and value - others >= MIN_PHASE_S:
            ratios[rank] = value / others
    if not ratios:
        return []
    flagged = sorted(ratios, key=lambda r: -ratios[r])
    worst = ratios[flagged[0]]
    comm_wait = {p.rank: rounded(p.comm_wait_s) for p in phases if p.comm_wait_s is not None}
    hosts = {p.rank: p.hostname for p in phases if p.rank in ratios and p.hostname}
    evidence = {
        "local_compute_s": {r: rounded(v) for r, v in means.items() if v is not None},
        "ratio_to_median_of_others": {r: rounded(ratios[r]) for r in flagged},
        "slow_windows": {r: slow_windows[r] for r in flagged},
        "windows": len(windows),
        "source": source,
        "comm_wait_s": comm_wait,  # the others' wait at the collective is the time lost to the straggler
        "hostnames": hosts,
        "threshold_ratio": STRAGGLER_RATIO,
    }
    severity = grade(worst, STRAGGLER_RATIO, STRAGGLER_CRITICAL_RATIO) or "warning"
    others = median(v for r, v in means.items() if r != flagged[0])
    where = f" on {hosts[flagged[0]]}" if flagged[0] in hosts else ""
    message = (
        f"{ranks_text(flagged)}{where} compute{'s' if len(flagged) == 1 else ''} {worst:.2f}x longer than the "
        f"others ({means[flagged[0]]:.3f} s vs {others:.3f} s local compute per step); every other rank waits "
        "for it at each collective"
    )
    return [Finding("straggler", severity, flagged, evidence, message, worst)]


def _profile_exposed(p: RankPhases) -> float | None:
    if p.profile_comm_s is None or p.profile_total_s is None:
        return None
    exposed = max(0.0, p.profile_comm_s - (p.profile_overlap_s or 0.0)) * p.profile_collective_share
    return ratio(exposed, p.profile_total_s)


def _saturation(p: RankPhases) -> float | None:
    """Profiled communication per step over the backward compute it can hide behind (DDP/FSDP overlap window)."""
    if p.profile_comm_s is None or p.backward_compute_s is None or p.backward_compute_s < MIN_PHASE_S:
        return None
    return p.profile_comm_s * p.profile_collective_share / p.backward_compute_s


def detect_comm_bound(run: RunTelemetry, phases: list[RankPhases]) -> list[Finding]:
    """Communication that every rank pays (minimums over ranks: fast ranks also wait for slow ones).

    Two ways to be bound by it. Exposed: the step's comm wait (DDP: the wait after this rank's own backward)
    or the profiler's communication not hidden behind compute (FSDP, whose waits happen inside backward where
    the step timer cannot separate them), whichever is larger. Saturated: the gradients take about as long to
    move as the backward takes to compute, so overlap has no headroom left and communication paces the step
    even when the profiler sees it overlapped (on CPUs the overlapped communication also competes for cores).
    """
    steps = _fractions(phases, "comm_wait_s")
    profile = {p.rank: f for p in phases if (f := _profile_exposed(p)) is not None}
    exposed = {r: max(steps.get(r, 0.0), profile.get(r, 0.0)) for r in set(steps) | set(profile)}
    saturation = {p.rank: s for p in phases if (s := _saturation(p)) is not None}
    timed = len([p for p in phases if p.step_s is not None or p.profile_total_s])
    floor = min(exposed.values()) if exposed and len(exposed) == timed else 0.0
    saturated = min(saturation.values()) if saturation and len(saturation) == timed else 0.0
    if floor < COMM_BOUND_FRACTION and saturated < COMM_SATURATION:
        return []
    evidence = {
        "exposed_comm_fraction": {r: rounded(f) for r, f in sorted(exposed.items())},
        "min_over_ranks": rounded(floor),
        "step_comm_wait_fraction": {r: rounded(f) for r, f in sorted(steps.items())},
        "profile_exposed_comm_fraction": {r: rounded(f) for r, f in sorted(profile.items())},
        "comm_over_backward_compute": {r: rounded(s) for r, s in sorted(saturation.items())},
        "threshold_fraction": COMM_BOUND_FRACTION,
        "threshold_saturation": COMM_SATURATION,
    }
    ranks = sorted(set(exposed) | set(saturation))
    if floor >= COMM_BOUND_FRACTION:
        severity = grade(floor, COMM_BOUND_FRACTION, COMM_BOUND_CRITICAL_FRACTION) or "warning"
        message = (
            f"exposed communication takes at least {_pct(floor)} of every rank's step: the run is moving gradients"
        )
        return [Finding("comm_bound", severity, ranks, evidence, message, floor)]
    message = (
        f"communication needs {_pct(saturated)} of the backward compute it must hide behind "
        f"({_pct(floor)} of the step is exposed): overlap has no headroom left, gradient traffic paces the step"
    )
    return [Finding("comm_bound", "warning", ranks, evidence, message, saturated)]


def _low_util(run: RunTelemetry, phases: list[RankPhases]) -> dict[int, float]:
    """Mean NVML utilization of ranks whose idle device neither data wait nor communication explains."""
    out = {}
    for p in phases:
        util = mean(s.util_pct for s in run.ranks[p.rank].samples if s.source == "nvml")
        waits = (ratio(p.data_wait_s, p.step_s) or 0.0) + (ratio(p.comm_wait_s, p.step_s) or 0.0)
        if util is not None and util < LOW_DEVICE_UTIL_PCT and waits < EXPLAINED_WAIT_FRACTION:
            out[p.rank] = util
    return out


def _unexplained_idle(p: RankPhases) -> float | None:
    """Profiler idle time that neither the data wait nor the wait at a collective explains, per step.

    A loader running in the training process and DDP's end-of-backward wait both leave the profiled thread
    without ops (idle) while being data and communication problems, which their own detectors report.
    """
    if p.profile_idle_s is None or p.profile_total_s is None:
        return None
    return ratio(max(0.0, p.profile_idle_s - (p.data_wait_s or 0.0) - (p.comm_wait_s or 0.0)), p.profile_total_s)


def detect_host_overhead(run: RunTelemetry, phases: list[RankPhases]) -> list[Finding]:
    unattributed = _fractions(phases, "other_median_s")
    idle = {p.rank: f for p in phases if (f := _unexplained_idle(p)) is not None}
    low_util = _low_util(run, phases)
    worst_by_rank = {r: max(unattributed.get(r, 0.0), idle.get(r, 0.0)) for r in set(unattributed) | set(idle)}
    flagged = sorted({r for r, f in worst_by_rank.items() if f >= HOST_OVERHEAD_FRACTION} | set(low_util))
    if not flagged:
        return []
    worst = max((worst_by_rank.get(r, 0.0) for r in flagged), default=0.0)
    severity = grade(worst, HOST_OVERHEAD_FRACTION, HOST_OVERHEAD_CRITICAL_FRACTION) or "warning"
    evidence = {
        "unattributed_fraction": {r: rounded(f) for r, f in unattributed.items() if r in flagged},
        "profile_unexplained_idle_fraction": {r: rounded(f) for r, f in idle.items() if r in flagged},
        "device_util_pct": {r: rounded(u) for r, u in low_util.items()},
        "threshold_fraction": HOST_OVERHEAD_FRACTION,
    }
    if worst >= HOST_OVERHEAD_FRACTION:
        detail = f"{_pct(worst)} of the step runs no compute or communication and is not spent waiting for data"
    else:
        detail = f"the GPU is busy only {min(low_util.values()):.0f}% of the time with no data or comm wait"
    message = f"{ranks_text(flagged)}: {detail} (Python/framework/launch overhead)"
    return [Finding("host_overhead", severity, flagged, evidence, message, worst)]


def detect_pipeline_bubble(run: RunTelemetry, phases: list[RankPhases]) -> list[Finding]:
    bubbles = {
        rank: b for rank, tele in run.ranks.items() if (b := mean(s.bubble_fraction for s in steady(tele.steps)))
    }
    flagged = sorted(r for r, b in bubbles.items() if b >= BUBBLE_FRACTION)
    if not flagged:
        return []
    worst = max(bubbles[r] for r in flagged)
    severity = grade(worst, BUBBLE_FRACTION, BUBBLE_CRITICAL_FRACTION) or "warning"
    evidence = {"bubble_fraction": {r: rounded(bubbles[r]) for r in flagged}, "threshold_fraction": BUBBLE_FRACTION}
    message = f"{ranks_text(flagged)} idle {_pct(worst)} of each step in the pipeline schedule's bubble"
    return [Finding("pipeline_bubble", severity, flagged, evidence, message, worst)]
