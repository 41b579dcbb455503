"""Detectors over step timing: input_bound, comm_bound, host_overhead, pipeline_bubble (straggler: detect_ranks)."""

from __future__ import annotations

from typing import Any

from diagnostics.analysis.comm_split import comm_split
from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding, costed, ranks_text, ranks_verb
from diagnostics.analysis.finding import pct as _pct
from diagnostics.analysis.load import RankTelemetry, RunTelemetry, Sample
from diagnostics.analysis.phase_comm import timed_comm
from diagnostics.analysis.stats import mean, mean_lower_bound, median, present, ratio, rounded, steady
from diagnostics.analysis.summary import RankPhases, run_device, unattributed_s
from diagnostics.analysis.thresholds import (
    BUBBLE_FRACTION,
    COMM_BOUND_FRACTION,
    COMM_SATURATION,
    COST_WARNING,
    EXPLAINED_WAIT_FRACTION,
    HOST_OVERHEAD_FRACTION,
    INPUT_BOUND_FRACTION,
    INPUT_BOUND_PERSISTENCE,
    LOW_DEVICE_UTIL_PCT,
    MIN_PHASE_S,
    TOKENS_DOMINATE,
    WINDOW_AGREEMENT,
)


def _fractions(phases: list[RankPhases], key: str) -> dict[int, float]:
    """Per rank, mean ``key`` over mean step time, for ranks where the phase is above timer noise."""
    out = {}
    for p in phases:
        value = getattr(p, key)
        if value is not None and value >= MIN_PHASE_S and (f := ratio(value, p.step_s)) is not None:
            out[p.rank] = f
    return out


def _persistence(run: RunTelemetry, rank: int, key: str, fraction: float) -> float:
    """Share of a rank's steady steps in which ``key`` is at least ``fraction`` of the step."""
    steps = [s for s in steady(run.ranks[rank].steps) if s.step_s and getattr(s, key) is not None]
    return sum(1 for s in steps if getattr(s, key) >= fraction * (s.step_s or 0.0)) / len(steps) if steps else 0.0


def detect_input_bound(run: RunTelemetry, phases: list[RankPhases]) -> list[Finding]:
    """Ranks that wait for their next batch; the job waits for the slowest loader, so that is the cost.

    A rank whose batches are slow is the only one waiting in ``next(dataloader)``; the others wait for it at the
    next collective, which this detector never counts (see detect_ranks: they are not slow, they are waiting).
    """
    fractions = _fractions(phases, "data_wait_s")
    flagged = sorted(r for r, f in fractions.items() if f >= INPUT_BOUND_FRACTION)
    if not flagged:
        return []
    persistence = {r: _persistence(run, r, "data_wait_s", INPUT_BOUND_FRACTION) for r in flagged}
    worst_rank = max(flagged, key=lambda r: fractions[r])
    worst = fractions[worst_rank]
    by_rank = {p.rank: p for p in phases}
    evidence = {
        "slow_phase": "data",
        "data_wait_fraction": {r: rounded(fractions[r]) for r in flagged},
        "data_wait_s": {r: rounded(by_rank[r].data_wait_s) for r in flagged},
        "step_s": {r: rounded(by_rank[r].step_s) for r in flagged},
        "steps_above_threshold": {r: rounded(persistence[r]) for r in flagged},
        "threshold_fraction": INPUT_BOUND_FRACTION,
    }
    cpu = {r: share for r in flagged if (share := data_cpu_share(run, r)) is not None}
    if cpu:
        # Loading that computes on the training thread needs a core of its own to move to a worker; loading that
        # waits (I/O, a sleep, workers) does not.
        evidence["data_cpu_share"] = {r: rounded(v) for r, v in cpu.items()}
    message = (
        f"{ranks_verb(flagged, 'waits', 'wait')} for the next batch {_pct(worst)} of each step "
        f"({by_rank[worst_rank].data_wait_s:.3f} s of {by_rank[worst_rank].step_s:.3f} s; slow phase: data): "
        "the input pipeline cannot keep up"
    )
    basis = f"mean data wait / mean step time of rank {worst_rank} over {by_rank[worst_rank].steps} steps"
    # One slow batch (a cache miss, a file open) is not a slow pipeline: most steps must show the wait.
    steady_wait = persistence[worst_rank] >= INPUT_BOUND_PERSISTENCE
    return [costed("input_bound", flagged, evidence, message, worst, basis, corroborated=steady_wait, metric=worst)]


def data_cpu_share(run: RunTelemetry, rank: int) -> float | None:
    """The training thread's CPU time over its wall time inside next(dataloader), over the steady steps (None where
    the collector did not record it)."""
    steps = [s for s in steady(run.ranks[rank].steps) if s.data_cpu_s is not None and s.data_wait_s]
    wall = sum(s.data_wait_s or 0.0 for s in steps)
    return min(1.0, sum(s.data_cpu_s or 0.0 for s in steps) / wall) if wall else None


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


def _saturation(p: RankPhases, comm_s: float | None) -> float | None:
    """Profiled communication per step over the backward compute it can hide behind (DDP/FSDP overlap window)."""
    if comm_s is None or p.backward_compute_s is None or p.backward_compute_s < MIN_PHASE_S:
        return None
    return comm_s / p.backward_compute_s


def _step_transfers(run: RunTelemetry) -> list[tuple[float, float]]:
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
    rows = _step_transfers(run)
    return ratio(sum(w for w, _ in rows), sum(t for _, t in rows)) if rows else None


def step_transfer_lower_bound(run: RunTelemetry) -> float | None:
    """The lower 95% bound of the mean per-step share of exposed communication (see step_transfer_fraction).

    On a shared host the share jumps from step to step (a healthy DDP run under load: median 2%, one step 41%):
    a warning must rest on more than a few such steps.
    """
    return mean_lower_bound([w / t for w, t in _step_transfers(run)])


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


def token_exchange(run: RunTelemetry) -> dict[str, float] | None:
    """Expert parallelism's all-to-alls: their share of the step, its transfer and waiting, and the transfer's share
    of everything the phases' timed collectives moved (``of_phase_transfer``); None where none were timed."""
    comm = timed_comm(run)
    exchange = comm.all_to_all() if comm is not None else None
    if comm is None or exchange is None or comm.step_s <= 0:
        return None
    transfer = comm.transfer_s / comm.step_s
    of_transfer = min(1.0, exchange["transfer"] / transfer) if transfer > 0 else 0.0
    return {**exchange, "of_phase_transfer": rounded(of_transfer, 3) or 0.0}


def gradient_wait_timed(context: RunContext, steps: dict[int, float], timed: int) -> bool:
    """Whether the whole run's step records measure every rank's exposed gradient communication: DDP's, whose
    comm hook wraps every bucket, so what its all-reduce does not hide behind backward is its wait after backward,
    timed every step. There the exposure comes from them, not from the one profile window."""
    return context.strategy == "ddp" and timed > 0 and len(steps) == timed


def window_agrees(steps: dict[int, float], profile: dict[int, float]) -> bool:
    """Whether the profile window's collectives are DDP's gradients: the exposure it shows is within
    WINDOW_AGREEMENT of what the step records time every step. Where it is far above, the window holds other
    collectives (a metric logged with ``sync_dist``, the preemption vote), which no gradient lever removes, or a
    profiler that stretches each call on small steps, and its collective time says nothing of the gradients'
    saturation (benchmarks/RESULTS.md: a small classifier's window read seven times its step records, whose
    figure keeping the gradients local confirmed)."""
    return bool(profile) and min(profile.values()) <= WINDOW_AGREEMENT * max(min(steps.values()), MIN_PHASE_S)


def detect_comm_bound(run: RunTelemetry, phases: list[RankPhases]) -> list[Finding]:
    """Communication that every rank pays (minimums over ranks: fast ranks also wait for slow ones).

    Two ways to be bound by it. Exposed: the step's comm wait (DDP: the wait after this rank's own backward)
    or the profiler's communication not hidden behind compute (FSDP, whose waits happen inside backward where
    the step timer cannot separate them), whichever is larger. Saturated: the gradients take about as long to
    move as the backward takes to compute, so overlap has no headroom left and communication paces the step
    even when the profiler sees it overlapped (on a CPU host whose cores the compute threads fill, the
    overlapped communication also takes cores from the compute: then it costs its whole time).

    A world of one rank moves nothing between ranks: what its profile calls collectives (FSDP2 over one rank) are
    local copies, host work that host_overhead weighs, and no layout or batch change would make them cheaper.
    """
    if run.world_size <= 1:
        return []
    steps, profile, exposed = exposed_comm(run, phases)
    comm_s = collective_comm_s(phases)
    saturation = {p.rank: s for p in phases if (s := _saturation(p, comm_s)) is not None}
    timed = len([p for p in phases if p.step_s is not None or p.profile_total_s])
    context = RunContext.from_run(run)
    busy = context.host_cores_busy()
    if gradient_wait_timed(context, steps, timed):
        exposed = dict(steps)
        if not window_agrees(steps, profile):
            saturation, busy = {}, False
    floor = min(exposed.values()) if exposed and len(exposed) == timed else 0.0
    saturated = min(saturation.values()) if saturation and len(saturation) == timed else 0.0
    # On a host whose compute threads fill every core the overlapped collectives run on the compute's cores: all of
    # their time is the step's (benchmarks/RESULTS.md: 4 ranks of FSDP at 26% read nothing, reshard_after_forward
    # then gained ~11%).
    whole = min((ratio(comm_s, p.profile_total_s) or 0.0) for p in phases) if busy and comm_s and phases else 0.0
    crowded = whole >= COMM_BOUND_FRACTION and len(profile) == timed
    if floor < COMM_BOUND_FRACTION and saturated < COMM_SATURATION and not crowded:
        return []
    evidence: dict[str, Any] = {
        "exposed_comm_fraction": {r: rounded(f) for r, f in sorted(exposed.items())},
        "min_over_ranks": rounded(floor),
        "step_comm_wait_fraction": {r: rounded(f) for r, f in sorted(steps.items())},
        "profile_exposed_comm_fraction": {r: rounded(f) for r, f in sorted(profile.items())},
        "comm_over_backward_compute": {r: rounded(s) for r, s in sorted(saturation.items())},
        "threshold_fraction": COMM_BOUND_FRACTION,
        "threshold_saturation": COMM_SATURATION,
    }
    exchange = token_exchange(run)
    split = comm_split(run, context)
    if split is not None:
        evidence["comm_split"] = split
    moving = "gradients"
    no_dp = context.strategy == "megatron" and context.batch.get("data_parallel_size") == 1
    if no_dp or (split is not None and split["tensor_parallel"] >= TOKENS_DOMINATE):
        # No data parallelism (no gradient moves between ranks), or tensor parallelism's collectives are most of
        # the traffic: activations move, every micro-batch.
        moving = "activations between model-parallel ranks"
    if exchange is not None:
        evidence["all_to_all"] = exchange
        if exchange["of_phase_transfer"] >= TOKENS_DOMINATE:
            moving = f"tokens between expert-parallel ranks (all-to-all: {_pct(exchange['transfer'])} of the step)"
    headroom = [
        p.device_memory_bytes - p.peak_reserved_bytes for p in phases if p.device_memory_bytes and p.peak_reserved_bytes
    ]
    if headroom:  # what a lever that holds more per rank (ZeRO-2's whole parameters) has to fit in
        evidence["device_headroom_bytes"] = min(headroom)
    if isinstance(params := run.meta("num_parameters"), int):
        evidence["num_parameters"] = params
    ranks = sorted(set(exposed) | set(saturation))
    # Whole-run step records for every rank, or the windows of at least two ranks, must agree on the floor.
    corroborated = len(steps) == timed or len(profile) >= 2
    if floor >= COMM_BOUND_FRACTION:
        basis = "exposed communication / step time, minimum over ranks (step records' comm wait or profile window)"
        message = f"exposed communication takes at least {_pct(floor)} of every rank's step: the run is moving {moving}"
        return [costed("comm_bound", ranks, evidence, message, floor, basis, corroborated=corroborated, metric=floor)]
    fraction, basis = floor, "exposed communication / step time (overlapped communication runs beside compute)"
    evidence["host_cores_busy"] = busy
    if busy:
        fraction = floor + max(0.0, whole - floor)
        basis = "all profiled communication / step time: the compute threads fill every core, so it takes their time"
    if saturated < COMM_SATURATION:  # crowded: bound by the cores the collectives take, not by the overlap window
        evidence["all_comm_fraction"] = rounded(whole)
        message = (
            f"communication takes {_pct(whole)} of the step ({_pct(floor)} exposed, the rest beside compute on a "
            f"host whose compute threads fill every core, so on the compute's cores): moving {moving} costs the step"
        )
        return [
            costed("comm_bound", ranks, evidence, message, fraction, basis, corroborated=corroborated, metric=whole)
        ]
    message = (
        f"communication needs {_pct(saturated)} of the backward compute it must hide behind "
        f"({_pct(floor)} of the step is exposed): overlap has no headroom left, moving {moving} paces the step"
    )
    return [
        costed("comm_bound", ranks, evidence, message, fraction, basis, corroborated=corroborated, metric=saturated)
    ]


def _low_util(run: RunTelemetry, phases: list[RankPhases]) -> dict[int, float]:
    """Mean NVML utilization over the training steps of ranks whose idle device neither data wait nor communication
    explains. Only without a profile window: the window times the kernels themselves, and NVML's mean over a short
    run is mostly start-up, compile time included (an H200 case: benchmarks/RESULTS.md)."""
    out = {}
    for p in phases:
        if p.profile_total_s is not None:
            continue
        util = mean(s.util_pct for s in training_samples(run.ranks[p.rank]) if s.source == "nvml")
        waits = (ratio(p.data_wait_s, p.step_s) or 0.0) + (ratio(p.comm_wait_s, p.step_s) or 0.0)
        if util is not None and util < LOW_DEVICE_UTIL_PCT and waits < EXPLAINED_WAIT_FRACTION:
            out[p.rank] = util
    return out


def training_samples(tele: RankTelemetry) -> list[Sample]:
    """The rank's samples taken while it ran its steady steps (all of them where steps carry no start time)."""
    steps = [s for s in steady(tele.steps) if s.start_t and s.step_s is not None]
    if not steps:
        return tele.samples
    first, last = steps[0].start_t or 0.0, max((s.start_t or 0.0) + (s.step_s or 0.0) for s in steps)
    inside = [s for s in tele.samples if first <= s.t <= last]
    return inside or tele.samples


def _unexplained_idle(p: RankPhases) -> float | None:
    """Profiler idle time that neither the data wait nor the wait at a collective explains, per step.

    A loader running in the training process and DDP's end-of-backward wait both leave the profiled thread
    without ops (idle) while being data and communication problems, which their own detectors report.
    """
    if p.profile_idle_s is None or p.profile_total_s is None:
        return None
    return ratio(max(0.0, p.profile_idle_s - (p.data_wait_s or 0.0) - (p.comm_wait_s or 0.0)), p.profile_total_s)


def host_unattributed(run: RunTelemetry, phases: list[RankPhases]) -> dict[int, float]:
    """``shared_unattributed`` where host clocks time the work (CPU); nothing on a GPU (see ``run_device``)."""
    return {} if run_device(run) == "gpu" else shared_unattributed(run, phases)


def device_idle(phases: list[RankPhases]) -> float | None:
    """The smallest share of a profiled step any rank's device spent with no kernel running, beyond its data and
    communication waits: what every rank pays for a host that does not keep its device fed (None: no profile)."""
    return min(present(_unexplained_idle(p) for p in phases), default=None)


def shared_unattributed(run: RunTelemetry, phases: list[RankPhases]) -> dict[int, float]:
    """Per rank, the typical step's time outside every phase that *every* rank pays, over the step time.

    Per step the minimum over ranks: a collective between steps (a preemption vote, a logging sync) holds the
    ranks that reach it first, so their unattributed time includes waiting for a slow one; the last to arrive
    waits for no one. A rank slow between steps is a straggler (slow phase: other), not host overhead of all.
    """
    if len(run.ranks) < 2:
        return _fractions(phases, "other_median_s")
    by_step: dict[int, list[tuple[float, float]]] = {}
    for tele in run.ranks.values():
        for s in steady(tele.steps):
            if (other := unattributed_s(s)) is not None and s.step_s:
                by_step.setdefault(s.step, []).append((other, s.step_s))
    rows = [pairs for pairs in by_step.values() if len(pairs) == len(run.ranks)]
    typical = median(min(o for o, _ in pairs) for pairs in rows)
    step_s = mean(max(t for _, t in pairs) for pairs in rows)
    if typical is None or typical < MIN_PHASE_S or not step_s:
        return {}
    return {p.rank: typical / step_s for p in phases}


def detect_host_overhead(run: RunTelemetry, phases: list[RankPhases]) -> list[Finding]:
    # On a GPU the time outside the host-timed phases is the host waiting for queued kernels, not overhead: there only
    # the device's own idle time (the profile's kernels, NVML's utilization) says the host failed to keep it busy.
    unattributed = host_unattributed(run, phases)
    idle = {p.rank: f for p in phases if (f := _unexplained_idle(p)) is not None}
    if len(idle) > 1:  # the same for the profile: a rank idles while it waits for a slow one
        idle = dict.fromkeys(idle, min(idle.values()))
    low_util = _low_util(run, phases)
    worst_by_rank = {r: max(unattributed.get(r, 0.0), idle.get(r, 0.0)) for r in set(unattributed) | set(idle)}
    flagged = sorted({r for r, f in worst_by_rank.items() if f >= HOST_OVERHEAD_FRACTION} | set(low_util))
    if not flagged:
        return []
    evidence = {
        "unattributed_fraction": {r: rounded(f) for r, f in unattributed.items() if r in flagged},
        "profile_unexplained_idle_fraction": {r: rounded(f) for r, f in idle.items() if r in flagged},
        "device_util_pct": {r: rounded(u) for r, u in low_util.items()},
        "threshold_fraction": HOST_OVERHEAD_FRACTION,
    }
    steps_say = max((unattributed.get(r, 0.0) for r in flagged), default=0.0)
    window_says = max((idle.get(r, 0.0) for r in flagged), default=0.0)
    if steps_say >= HOST_OVERHEAD_FRACTION:
        # The typical (median) step of the whole run: corroborated by half of the steps at least.
        fraction, corroborated = steps_say, True
        basis = "median over steps of the time outside every timed phase (minimum over ranks) / mean step time"
        detail = f"{_pct(fraction)} of the step runs no compute or communication and is not spent waiting for data"
    elif window_says >= HOST_OVERHEAD_FRACTION:
        fraction, basis = window_says, "profiler idle not explained by data or comm wait / profiled step"
        corroborated = len([r for r in idle if idle[r] >= HOST_OVERHEAD_FRACTION]) >= 2  # several windows agree
        detail = f"{_pct(fraction)} of the profiled step runs no op and is not spent waiting for data or peers"
    else:
        util = min(low_util.values())
        fraction, corroborated = 1.0 - util / 100.0, True
        basis = "idle share of the GPU's sampled utilization (an upper bound)"
        detail = f"the GPU is busy only {util:.0f}% of the time with no data or comm wait"
    message = f"{ranks_text(flagged)}: {detail} (Python/framework/launch overhead)"
    return [costed("host_overhead", flagged, evidence, message, fraction, basis, corroborated=corroborated)]


def detect_pipeline_bubble(run: RunTelemetry, phases: list[RankPhases]) -> list[Finding]:
    """Idle time inside the pipeline schedule. Its cost is the idle share every stage pays (the least idle stage's):
    a stage that idles more than that waits for a slower peer, and that wait is the peer's cost (detect_ranks
    blames a stage slow outside its schedule; a stage slower inside it is an imbalance of the stages' work)."""
    bubbles = {
        rank: b for rank, tele in run.ranks.items() if (b := mean(s.bubble_fraction for s in steady(tele.steps)))
    }
    flagged = sorted(r for r, b in bubbles.items() if b >= BUBBLE_FRACTION)
    if not flagged:
        return []
    every_stage = min(bubbles.values())
    worst = max(bubbles[r] for r in flagged)
    evidence = {
        "bubble_fraction": {r: rounded(bubbles[r]) for r in flagged},
        "every_stage_fraction": rounded(every_stage),
        "threshold_fraction": BUBBLE_FRACTION,
    }
    message = f"{ranks_verb(flagged, 'idles', 'idle')} {_pct(worst)} of each step in the pipeline schedule"
    if worst - every_stage >= COST_WARNING:
        least = min(bubbles, key=lambda r: bubbles[r])
        message += (
            f"; {_pct(every_stage)} is the bubble every stage pays, the rest is waiting for rank {least} "
            "(slower than the other stages)"
        )
    else:
        message += "'s bubble"
    basis = "mean idle time inside the schedule / step time, least idle stage (the bubble all pay), steady steps"
    return [costed("pipeline_bubble", flagged, evidence, message, every_stage, basis, metric=every_stage)]
