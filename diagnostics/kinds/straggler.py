"""``straggler``: one rank is slower and the others wait for it at every collective. No config lever moves a slow
host or device; the recommendation names the rank, its slow phase and where to look.
"""

from __future__ import annotations

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding, costed, ranks_text, ranks_verb
from diagnostics.analysis.load import RunTelemetry, StepRecord
from diagnostics.analysis.stats import interquartile_mean, mean, median, percentile, present, rounded, steady
from diagnostics.analysis.summary import RankPhases, Summary, job_step_moved, job_step_times
from diagnostics.analysis.thresholds import MIN_PHASE_S
from diagnostics.kinds.levers import ALL_OF_IT, Recommendation, gain, no_lever

# straggler, by order of arrival: per step, how much later than the earliest rank a rank reaches the end of each
# phase (its lateness). A rank that is slow in a phase falls behind during that phase; a rank that only waits
# for it at a collective never falls behind, it is caught up with. On a shared host every rank falls behind
# now and then (on the README's default run under load: ~70 ms a step each, the scheduler's choice), so what
# counts is how much more one rank falls behind than the others' median: at least 5% of the step (the warning
# cost) and in at least 70% of the steps (random preemption puts a rank behind in about half of them).
STRAGGLER_MIN_COST = 0.05
STRAGGLER_PERSISTENCE = 0.7
# Another rank is named beside the one that falls behind most only if it falls behind at least this share as much:
# a much smaller lag is what waiting inside an untimed collective leaves behind (4 ranks, gloo's broadcast tree: the
# rank relaying DDP's buffer broadcast to a late rank lagged 12 ms a step beside that rank's 79 ms) or what the
# scheduler hands out when ranks share cores. Fixing the first shows the next.
STRAGGLER_SECONDARY_SHARE = 1 / 3
# An intermittent straggler (``_stalls``): a step in which one rank fell behind the others, beyond its usual excess,
# by at least STALL_FRACTION of the typical step and STALL_NOISE times the spread of its own excess (a robust
# standard deviation) is a stall; it takes MIN_STALLS of them to call it a pattern, not a one-off. A tenth of the
# step, not a quarter: stalls just under a quarter still cost a run several percent. Four spreads, not five: a rank
# stalling in a quarter of its steps widens its own spread (the seeds behind both: benchmarks/RESULTS.md,
# "Intermittent stalls"). Shared-host noise hits every rank alike: the rank named must also lose at least twice what
# any other rank loses to its own stalls. A pattern costing STALL_MIN_COST is reported as info below the warning
# cost: what the run's tail steps are, even where fixing it would gain little.
STALL_FRACTION = 0.10
STALL_NOISE = 4.0
MIN_STALLS = 3
STALL_MIN_COST = 0.02
# Records without phase start times (older collectors): a rank's local compute against the median of the other
# ranks; identical ranks on shared CPUs differ by ~5-10% from scheduling noise, 25% is outside that band.
STRAGGLER_RATIO = 1.25
# The thresholds above, by name, for the report (report.json's ``thresholds``).
THRESHOLDS = {
    "STRAGGLER_MIN_COST": STRAGGLER_MIN_COST,
    "STRAGGLER_PERSISTENCE": STRAGGLER_PERSISTENCE,
    "STRAGGLER_SECONDARY_SHARE": STRAGGLER_SECONDARY_SHARE,
    "STALL_FRACTION": STALL_FRACTION,
    "STALL_NOISE": STALL_NOISE,
    "MIN_STALLS": MIN_STALLS,
    "STALL_MIN_COST": STALL_MIN_COST,
    "STRAGGLER_RATIO": STRAGGLER_RATIO,
}


# (segment of the step record, its phase). DDP's comm wait is where the others catch up with a slow rank: the
# slow rank's lateness shrinks there, so it stays a phase of its own instead of cancelling backward compute.
SEGMENTS = (
    ("other", "other"),
    ("data", "data"),
    ("forward", "forward"),
    ("forward_comm", "forward_comm"),
    ("backward_compute", "backward"),
    ("backward_comm", "backward_comm"),
    ("comm_wait", "comm_wait"),
    ("optimizer", "optimizer"),
    ("optimizer_comm", "optimizer_comm"),
    ("schedule", "schedule"),
)


# A rank that falls behind inside a collective: its own transfer is slow, in the phase that issued it.
NAMED = {"comm_wait": "backward", "forward_comm": "forward", "backward_comm": "backward", "optimizer_comm": "optimizer"}


def segments(s: StepRecord) -> list[float] | None:
    """The step's phases in time order (seconds), or None if the record lacks what the order needs. A pipeline
    stage's schedule (its forward and backward compute and the waits between them) is the last segment: where it
    sits in the step does not change whose lateness grows outside it."""
    if s.start_t is None or s.step_s is None or s.forward_s is None or s.backward_s is None:
        return None
    data, wait, optimizer = s.data_wait_s or 0.0, s.comm_wait_s or 0.0, s.optimizer_s or 0.0
    if s.bubble_fraction is not None:
        schedule = s.forward_s + s.backward_s + s.bubble_fraction * s.step_s
        other = max(0.0, s.step_s - data - schedule - optimizer)
        return [other, data, 0.0, 0.0, 0.0, 0.0, 0.0, optimizer, 0.0, schedule]
    other = max(0.0, s.step_s - data - s.forward_s - s.backward_s - optimizer)
    backward = max(0.0, s.backward_s - wait)
    forward_comm = min(s.forward_comm_s or 0.0, s.forward_s)
    backward_comm = min(s.backward_comm_s or 0.0, backward)
    optimizer_comm = min(s.optimizer_comm_s or 0.0, optimizer)
    return [other, data, s.forward_s - forward_comm, forward_comm, backward - backward_comm, backward_comm, wait,
            optimizer - optimizer_comm, optimizer_comm, 0.0]  # fmt: skip


def lateness_growth(run: RunTelemetry) -> list[tuple[float, dict[int, list[float]]]]:
    """Per steady step that at least two ranks recorded: the job's step time (the slowest rank's) and per rank,
    how much it fell behind in each segment."""
    by_step: dict[int, dict[int, StepRecord]] = {}
    for rank, tele in run.ranks.items():
        for s in steady(tele.steps):
            by_step.setdefault(s.step, {})[rank] = s
    out: list[tuple[float, dict[int, list[float]]]] = []
    previous_end: float | None = None
    previous_step: int | None = None
    for step in sorted(by_step):
        rows = {r: seg for r, rec in by_step[step].items() if (seg := segments(rec)) is not None}
        if len(rows) < 2:
            continue
        ends = {r: [by_step[step][r].start_t or 0.0] for r in rows}
        for r, seg in rows.items():
            for seconds in seg:
                ends[r].append(ends[r][-1] + seconds)
        first = [min(ends[r][i] for r in rows) for i in range(len(SEGMENTS) + 1)]
        late = {r: [ends[r][i] - first[i] for i in range(len(SEGMENTS) + 1)] for r in rows}
        # How far the job moved this step (summary.job_step_moved): a hold counts once, not in two steps.
        spans = [(ends[r][0], ends[r][-1]) for r in rows]
        job_step_s = job_step_moved(spans, previous_end if previous_step == step - 1 else None)
        previous_end, previous_step = max(end for _, end in spans), step
        out.append((job_step_s, {r: _growth(late, r) for r in rows}))
    return out


def _growth(late: dict[int, list[float]], rank: int) -> list[float]:
    """How far ``rank`` fell behind in each segment, less what it may have spent waiting for a rank that was already
    later when the segment began. A collective that relays through ranks (gloo's broadcast tree: DDP's buffer
    broadcast at the start of forward, on 4 ranks) holds the relay rank until the late rank arrives while the
    others go on: the relay rank falls behind inside its phase, but never further than the late rank already was
    (4 ranks, rank 3 slow in its optimizer: rank 1 read slow in forward by the same 68 ms). A rank slow in its own
    work while another is late gets past that lateness, and the part beyond it still counts."""
    others = [r for r in late if r != rank]
    out = []
    for i in range(len(SEGMENTS)):
        grew = late[rank][i + 1] - late[rank][i]
        if grew > 0 and others:
            already = max(late[r][i] for r in others) - late[rank][i]
            grew -= min(grew, max(0.0, already))
        out.append(grew)
    return out


def _by_phase(per_step: list[list[float]]) -> dict[str, float]:
    """Phase -> mean growth per step."""
    out: dict[str, float] = {}
    for phase in dict.fromkeys(name for _, name in SEGMENTS):
        idx = [i for i, (_, name) in enumerate(SEGMENTS) if name == phase]
        out[phase] = sum(sum(row[i] for i in idx) for row in per_step) / len(per_step)
    return out


def _slowest_phase(growth: dict[str, float]) -> str:
    """The phase a rank fell behind most in; a pipeline's schedule is never one (see the module docstring)."""
    return max((p for p in growth if p != "schedule"), key=lambda p: growth[p])


def _fell_behind(row: list[float], data: bool = False) -> float:
    """Seconds a rank fell behind in one step, over every phase but data (input_bound's, with its own levers)
    unless ``data``, and but a pipeline's schedule (whose stages differ by design)."""
    counted = [name != "schedule" and (data or name != "data") for _, name in SEGMENTS]
    return sum(max(0.0, g) for g, keep in zip(row, counted, strict=True) if keep)


def _excess(
    steps: list[tuple[float, dict[int, list[float]]]], rank: int, data: bool = False
) -> list[tuple[float, float]]:
    """Per step, how much more ``rank`` fell behind than the median of the other ranks, and the step's time.

    On a shared host every rank falls behind now and then (the scheduler preempts one, then the other): both
    show the same mean fall-behind. Only what one rank loses beyond the others is a straggler's. In a step where
    another rank is held as long elsewhere (rank 0 writing a log line), the slow rank costs nothing: excess 0.
    """
    out = []
    for step_s, step in steps:
        if rank in step:
            others = median(_fell_behind(row, data) for r, row in step.items() if r != rank) or 0.0
            out.append((_fell_behind(step[rank], data) - others, step_s))
    return out


def detect(run: RunTelemetry, summary: Summary, phases: list[RankPhases]) -> list[Finding]:
    steps = lateness_growth(run)
    if not steps:
        return _by_local_compute(run, phases)
    step_s = mean(job_step_times(run)) or 0.0
    slow: dict[int, tuple[str, float, float]] = {}  # rank -> (phase, seconds per step, persistence)
    table: dict[int, dict[str, float]] = {}
    shares: dict[int, float] = {}  # rank -> the share of the run's time it costs
    meetings, durations = _meetings(steps), _durations_by_step(run)
    for rank in sorted({r for _, step in steps for r in step}):
        per_step = [step[rank] for _, step in steps if rank in step]
        growth = _by_phase(per_step)
        table[rank] = {p: rounded(v) or 0.0 for p, v in growth.items()}
        phase = NAMED.get(top := _slowest_phase(growth), top)
        excess = _excess(steps, rank)
        seconds = sum(e for e, _ in excess) / len(excess)
        share = sum(1 for e, _ in excess if e > 0) / len(excess)
        shares[rank] = _gain_at_others_pace(steps, rank, _own_excess(durations, rank, growth), meetings)
        if phase != "data" and step_s and seconds >= STRAGGLER_MIN_COST * step_s and share >= STRAGGLER_PERSISTENCE:
            slow[rank] = (phase, seconds, share)
    stalls = _stalls(run, steps, phases)
    if not slow:
        return stalls
    worst = max(slow, key=lambda r: slow[r][1])
    flagged = sorted(
        (r for r in slow if slow[r][1] >= STRAGGLER_SECONDARY_SHARE * slow[worst][1]), key=lambda r: -slow[r][1]
    )
    if stalls and stalls[0].ranks == [worst] and stalls[0].cost_fraction > shares[worst]:
        # Behind in most steps by a little, and by a lot every few steps: the typical step's cost would hide the
        # stalls that make up most of the loss (benchmarks/RESULTS.md, "Figures moved from the code").
        return stalls
    hosts = {p.rank: p.hostname for p in phases if p.rank in flagged and p.hostname}
    evidence = {
        "slow_phase": slow[worst][0],
        "slow_phase_by_rank": {r: slow[r][0] for r in flagged},
        "falls_behind_s_per_step": {r: rounded(slow[r][1]) for r in flagged},
        "steps_behind_the_others": {r: rounded(slow[r][2]) for r in flagged},
        "lateness_growth_s_per_step": table,  # per rank and phase; a waiting rank's stays near zero
        "steps": len(steps),
        "step_s": rounded(step_s),
        "share_of_step_by_rank": {r: rounded(shares[r]) for r in flagged},
        "source": "order of arrival (step start times + phases)",
        "hostnames": hosts,
        "threshold_cost": STRAGGLER_MIN_COST,
    }
    parts = [
        f"rank {r}{f' on {hosts[r]}' if r in hosts else ''} is slow in {slow[r][0]} "
        f"(+{1e3 * slow[r][1]:.0f} ms per step)"
        for r in flagged
    ]
    waiting = sorted(set(table) - set(flagged))
    message = "; ".join(parts)
    if waiting:
        message += f": {ranks_verb(waiting, 'waits', 'wait')} for {'it' if len(flagged) == 1 else 'them'}"
    basis = (
        f"per step over {len(steps)} steps, how long the others waited for rank {worst} beyond their wait for the "
        "latest of them, at most its own work's excess over theirs (the skew paid without it stays) / mean step time"
    )
    return [costed("straggler", sorted(flagged), evidence, message, shares[worst], basis)]


# Segments where ranks meet: the timed collectives of each phase, a pipeline's schedule, and the time between steps
# (Lightning's and the guard's per-step collectives, untimed). A rank's lateness shrinks there because the others wait
# for it; inside its own work it shrinks only because another rank's work took longer (nobody waits for it).
MEETINGS = frozenset(("other", "forward_comm", "backward_comm", "comm_wait", "optimizer_comm", "schedule"))


def _meetings(steps: list[tuple[float, dict[int, list[float]]]]) -> frozenset[str]:
    """The segments in which ranks wait for each other in this run: ``MEETINGS``, unless the records do not time
    them (an older collector, FSDP's wait at the end of backward timed as compute), that is, unless most of the
    ranks' lateness shrinks elsewhere: then every segment, as the waits sit inside the work."""
    shrink = {name: 0.0 for _, name in SEGMENTS}
    for _, step in steps:
        for row in step.values():
            for g, (_, name) in zip(row, SEGMENTS, strict=True):
                shrink[name] += max(0.0, -g)
    total = sum(shrink.values())
    timed = sum(v for name, v in shrink.items() if name in MEETINGS)
    return MEETINGS if total <= 0 or timed >= total / 2 else frozenset(shrink)


def _waited_for(step: dict[int, list[float]], rank: int, meetings: frozenset[str]) -> float:
    """Seconds the job waited for ``rank`` in one step beyond its wait for the latest other rank: where ranks meet
    (``meetings``) each one's lateness shrinks by how late it arrived, so per meeting the rank's shrink less the
    largest other's."""
    others = [row for r, row in step.items() if r != rank]
    return sum(
        max(0.0, max(0.0, -g) - max(max(0.0, -row[i]) for row in others))
        for i, (g, (_, name)) in enumerate(zip(step[rank], SEGMENTS, strict=True))
        if name in meetings
    )


def _durations_by_step(run: RunTelemetry) -> list[dict[int, list[float]]]:
    """Per steady step that at least two ranks recorded: each rank's segment durations (``segments``)."""
    by_step: dict[int, dict[int, list[float]]] = {}
    for r, tele in run.ranks.items():
        for record in steady(tele.steps):
            if (seg := segments(record)) is not None:
                by_step.setdefault(record.step, {})[r] = seg
    return [rows for rows in by_step.values() if len(rows) > 1]


def _own_excess(durations: list[dict[int, list[float]]], rank: int, growth: dict[str, float]) -> float:
    """The time ``rank`` spends per step beyond the others on its own work in the phases it falls behind in (those
    within STRAGGLER_SECONDARY_SHARE of its slowest): per step, its segments' durations less the other ranks'
    median, the interquartile mean over steps. From durations, not lateness: another rank held earlier in the step
    (a shared host's scheduler, a log write) changes who is late, not how long this rank's work took."""
    top = max((v for p, v in growth.items() if p not in ("data", "schedule")), default=0.0)
    slow = [i for i, (_, name) in enumerate(SEGMENTS) if name not in ("data", "schedule") and top > 0
            and growth.get(name, 0.0) >= STRAGGLER_SECONDARY_SHARE * top]  # fmt: skip
    diffs = [
        sum(rows[rank][i] - (median(row[i] for o, row in rows.items() if o != rank) or 0.0) for i in slow)
        for rows in durations
        if rank in rows
    ]
    return max(0.0, interquartile_mean(diffs) or 0.0)


def _gain_at_others_pace(
    steps: list[tuple[float, dict[int, list[float]]]], rank: int, own_s: float, meetings: frozenset[str]
) -> float:
    """What the run would gain if ``rank`` kept the others' pace, as a share of its mean step.

    Per step the job waits for the rank as long as the others waited for it beyond their wait for the latest of
    them (``_waited_for`` at ``meetings``); at the others' pace it would still arrive with its own noise, so a step
    gains that wait up to the rank's own excess ``own_s`` (``_own_excess``). A rank slow by a lot absorbs the skew
    the host puts between the ranks (the others' holds hide in their wait for it): the job pays that skew with or
    without the slow rank, so it is not the rank's cost, and a step in which another rank was held longer elsewhere
    gains nothing. Over the mean step, not the typical one: the share of the run's time, which is what its
    throughput gains (benchmarks/RESULTS.md: the median excess over the median step read 12-14 points above the
    measured gain on small DDP steps).
    """
    mine = [(t, step) for t, step in steps if rank in step]  # lateness_growth: at least two ranks every step
    mean_step = mean(t for t, _ in mine) or 0.0
    if own_s <= 0 or mean_step <= 0:
        return 0.0
    return (mean(min(_waited_for(step, rank, meetings), own_s) for _, step in mine) or 0.0) / mean_step


def _usual_excess(excess: list[tuple[float, float]]) -> float:
    """What a rank loses beyond the others in its ordinary steps (the lower quartile of its excess): a stall is
    measured above it. A rank slow by the same amount every step is persistently slow, not stalling, however
    close that amount sits to the stall threshold (half its steps would cross it by noise alone)."""
    return max(0.0, percentile([e for e, _ in excess], 25.0) or 0.0)


def _excess_spread(excess: list[tuple[float, float]]) -> float:
    """The rank's step-to-step noise in what it loses beyond the others: 1.4826 x the median absolute deviation (a
    standard deviation that the stalls themselves, a minority of the steps, do not inflate)."""
    values = [e for e, _ in excess]
    centre = median(values) or 0.0
    return 1.4826 * (median(abs(v - centre) for v in values) or 0.0)


def _stall_steps(excess: list[tuple[float, float]], typical_s: float) -> list[int]:
    """Indices of the steps in which a rank fell behind the others by a stall: beyond what the other ranks lost in
    the same step (``excess``) and its own usual excess, by at least STALL_FRACTION of the typical step and
    STALL_NOISE times the spread of its excess."""
    usual = _usual_excess(excess)
    threshold = max(STALL_FRACTION * typical_s, STALL_NOISE * _excess_spread(excess))
    return [i for i, (e, _) in enumerate(excess) if e - usual >= threshold]


def _stall_cost(excess: list[tuple[float, float]], typical_s: float, total_s: float) -> float:
    """Seconds a rank's stalls cost the run (beyond its usual excess) over the run's ``total_s``: what its mean
    throughput would gain without them."""
    usual = _usual_excess(excess)
    lost = sum(excess[i][0] - usual for i in _stall_steps(excess, typical_s))
    return lost / total_s if total_s else 0.0


def _stalls(
    run: RunTelemetry, steps: list[tuple[float, dict[int, list[float]]]], phases: list[RankPhases]
) -> list[Finding]:
    """A rank that stalls now and then (a GC pause, a noisy neighbour, a periodic host task): too rare for the
    typical step to show it, too long for the mean throughput to hide it. Costed on the run's time, with the
    pattern (how often, how long, in which phase). On a shared host every rank stalls now and then: only a rank
    whose stalls cost at least twice any other rank's is named."""
    typical = median(t for t, _ in steps) or 0.0
    ranks = sorted({r for _, step in steps for r in step})
    excesses = {r: _excess(steps, r, data=True) for r in ranks}
    total = sum(t for t, _ in steps)
    costs = {r: _stall_cost(excesses[r], typical, total) for r in ranks}
    worst = max(ranks, key=lambda r: costs[r], default=None)
    if worst is None or costs[worst] < STALL_MIN_COST:
        return []
    if any(costs[r] * 2 > costs[worst] for r in ranks if r != worst):
        return []
    excess = excesses[worst]
    stall_idx = _stall_steps(excess, typical)
    # Fewer than MIN_STALLS is a one-off; in most steps it is persistent, the other detectors' case.
    if not MIN_STALLS <= len(stall_idx) <= len(steps) / 2:
        return []
    rows = [steps[i][1][worst] for i in stall_idx if worst in steps[i][1]]
    growth = _by_phase(rows)
    phase = NAMED.get(top := _slowest_phase(growth), top)
    kind_note = "loading its batches" if phase == "data" else phase
    per_stall = (mean(excess[i][0] for i in stall_idx) or 0.0) - _usual_excess(excess)
    every = len(steps) / len(stall_idx)
    host = next((p.hostname for p in phases if p.rank == worst and p.hostname), None)
    pattern = {
        "rank": worst,
        "phase": phase,
        "stalls": len(stall_idx),
        "of_steps": len(steps),
        "every_n_steps": rounded(every),
        "mean_stall_s": rounded(per_stall),
        "typical_step_s": rounded(typical),
    }
    evidence = {
        "pattern": pattern,
        "stall_cost_by_rank": {r: rounded(c) for r, c in costs.items()},
        "lateness_growth_s_per_stall": {p: rounded(v) for p, v in growth.items()},
        "source": "order of arrival (step start times + phases), steps where one rank fell behind by a stall",
        "hostnames": {worst: host} if host else {},
        "threshold_cost": STRAGGLER_MIN_COST,
    }
    waiting = [r for r in ranks if r != worst]
    message = (
        f"rank {worst}{f' on {host}' if host else ''} stalls in {kind_note} about every {every:.0f} steps "
        f"({len(stall_idx)} of {len(steps)}, +{1e3 * per_stall:.0f} ms each, the typical step {1e3 * typical:.0f} ms)"
        f": {ranks_verb(waiting, 'waits', 'wait')} for it each time"
    )
    basis = f"time lost to rank {worst}'s stalls beyond the other ranks / the run's time over {len(steps)} steps"
    # Graded on the cost less twice the rank's step-to-step noise per stall: a pattern whose cost is above the
    # warning line only by its own noise stays info (a matrix case: benchmarks/RESULTS.md, "Figures moved from the
    # code").
    lower = costs[worst] - 2.0 * _excess_spread(excess) * len(stall_idx) / total
    # A rank whose loader stalls is input-bound (its levers are the loader's); any other phase makes it a straggler.
    kind = "input_bound" if phase == "data" else "straggler"
    return [costed(kind, [worst], evidence, message, costs[worst], basis, metric=costs[worst], graded_on=lower)]


def _by_local_compute(run: RunTelemetry, phases: list[RankPhases]) -> list[Finding]:
    """Records without start times (older collectors): local compute against the other ranks' median.

    A rank that waits inside a phase counted as compute (FSDP's all-gathers, DDP's buffer broadcast) looks slow
    here too, so this is info at most.
    """
    local = {p.rank: p.local_compute_s for p in phases if p.local_compute_s is not None}
    if len(local) < 2:
        return []
    ratios = {}
    for rank, value in local.items():
        others = median(v for r, v in local.items() if r != rank)
        if value is not None and others and value >= STRAGGLER_RATIO * others and value - others >= MIN_PHASE_S:
            ratios[rank] = (value / others, value - others)
    if not ratios:
        return []
    flagged = sorted(ratios)
    worst = max(flagged, key=lambda r: ratios[r][1])
    step_s = mean(present(p.step_s for p in phases)) or 0.0
    evidence = {
        "local_compute_s": {r: rounded(v) for r, v in local.items()},
        "ratio_to_median_of_others": {r: rounded(ratios[r][0]) for r in flagged},
        "source": "per-rank local compute (no phase start times: waiting and working are not told apart)",
        "threshold_ratio": STRAGGLER_RATIO,
    }
    message = (
        f"{ranks_text(flagged)} compute {ratios[worst][0]:.2f}x longer than the others; without phase start times "
        "a rank that waits inside its compute looks the same"
    )
    basis = "excess local compute / mean step time (uncorroborated: waits may count as compute)"
    fraction = ratios[worst][1] / step_s if step_s else 0.0
    return [costed("straggler", flagged, evidence, message, fraction, basis, corroborated=False)]


# Where to look, by the phase a rank is slow in.
SLOW_PHASE_HINTS = {
    "forward": "its compute (other processes: top / nvidia-smi, clocks and temperature: nvidia-smi -q -d "
    "PERFORMANCE, CPU/NUMA binding) or rank-dependent work in the model's forward",
    "backward": "its compute (other processes, clocks, CPU/NUMA binding) or rank-dependent work in backward hooks",
    "optimizer": "its optimizer step (CPU offload, gradient clipping or hooks that run on this rank only)",
    "other": "work between steps on this rank only: logging, checkpoint writes, callbacks, rank-0-only hooks",
}


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    slow = finding.evidence.get("slow_phase_by_rank") or {}
    rank = max(finding.ranks, key=lambda r: (finding.evidence.get("falls_behind_s_per_step") or {}).get(r, 0.0))
    host = (finding.evidence.get("hostnames") or {}).get(rank)
    phase = slow.get(rank) or finding.evidence.get("slow_phase") or "forward"
    where = f"rank {rank}" + (f" on host {host}" if host else "")
    why = (
        f"{where} is slow in {phase} while the others wait for it; check {SLOW_PHASE_HINTS.get(phase, phase)}, and "
        "exclude a slow host (sbatch --exclude) if it stays slow"
    )
    expected = gain(finding, ALL_OF_IT, "the time the others wait for it per step")
    return [no_lever(why, "every rank at the others' pace").gaining(expected)]
