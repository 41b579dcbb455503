"""``input_bound``: the training loop waits for the next batch. Its levers are loader workers (sized from the
wait and the host's free cores), pinned memory and prefetching.
"""

from __future__ import annotations

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding, costed, ranks_verb
from diagnostics.analysis.finding import pct as _pct
from diagnostics.analysis.load import RunTelemetry
from diagnostics.analysis.stats import rounded, steady
from diagnostics.analysis.step_measures import phase_fractions
from diagnostics.analysis.summary import RankPhases, Summary
from diagnostics.kinds.levers import ALL_OF_IT, Recommendation, gain, lever, no_lever

# input_bound: a prefetching loader hides data loading completely, so any visible wait is a symptom; 5% (the
# warning cost) is well above timer noise and the first-batch effect. It must hold in at least half of the steps:
# one slow batch is not a slow pipeline.
INPUT_BOUND_FRACTION = 0.05
INPUT_BOUND_PERSISTENCE = 0.5
# The thresholds above, by name, for the report (report.json's ``thresholds``).
THRESHOLDS = {"INPUT_BOUND_FRACTION": INPUT_BOUND_FRACTION, "INPUT_BOUND_PERSISTENCE": INPUT_BOUND_PERSISTENCE}


def _persistence(run: RunTelemetry, rank: int, key: str, fraction: float) -> float:
    """Share of a rank's steady steps in which ``key`` is at least ``fraction`` of the step."""
    steps = [s for s in steady(run.ranks[rank].steps) if s.step_s and getattr(s, key) is not None]
    return sum(1 for s in steps if getattr(s, key) >= fraction * (s.step_s or 0.0)) / len(steps) if steps else 0.0


def detect(run: RunTelemetry, summary: Summary, phases: list[RankPhases]) -> list[Finding]:
    """Ranks that wait for their next batch; the job waits for the slowest loader, so that is the cost.

    A rank whose batches are slow is the only one waiting in ``next(dataloader)``; the others wait for it at the
    next collective, which this detector never counts (see kinds/straggler: they are not slow, they are waiting).
    """
    fractions = phase_fractions(phases, "data_wait_s")
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


# DataLoader workers beyond ~8 per rank rarely help (each is a process with its own copy of the dataset) and
# cost host memory; the target is the cores each rank has, at least 2 so that one batch loads while one waits.
MAX_WORKERS_PER_RANK = 8


MIN_WORKERS = 2


# When the training host's core count is unknown: GPU nodes have cores to spare; on a CPU run the training
# processes themselves use the cores, so fewer loader processes.
DEFAULT_GPU_WORKERS = 4


def share_hidden_by_workers(wait: float, current: int, workers: int) -> float:
    """The share of a data wait (``wait``: its share of the step) that ``workers`` loader processes per rank hide.

    Loading in the training process (``current`` 0) is serial: a batch takes the whole wait to load. With ``current``
    workers the loader delivers a batch per step, so each worker takes ``current`` steps per batch. ``workers``
    deliver one every load / workers, overlapped with the rest of the step: what remains of the wait is
    load / workers - rest (none once the workers keep up). A 0.3 s loader under a 0.03 s step (wait 0.91): two
    workers leave 0.12 s of it, the step 0.15 s instead of 0.33 s, +120% tokens/s, not the whole wait's +1000%."""
    if wait <= 0:
        return 0.0
    rest = 1.0 - wait
    load = wait if current == 0 else float(current)  # one batch's loading, in steps
    left = max(0.0, load / workers - rest)
    return max(0.0, min(1.0, (wait - left) / wait))


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    key = "data.num_workers" if ctx.has("data.num_workers") or not ctx.config else "+data.num_workers"
    current = ctx.get("data.num_workers") or 0
    target = DEFAULT_GPU_WORKERS if ctx.on_gpu else MIN_WORKERS
    if ctx.cpu_count:
        target = min(MAX_WORKERS_PER_RANK, max(MIN_WORKERS, ctx.cpu_count // ctx.local_ranks()))
    workers = max(target, 2 * current)
    wait = max(finding.evidence.get("data_wait_fraction", {0: 0.0}).values())
    now = "in the training process" if current == 0 else f"by {current} worker(s) per rank"
    why = f"batches are produced {now}; {workers} workers per rank load ahead while the current batch trains"
    if not key.startswith("data."):
        why += " (passed to your datamodule's constructor)"
    share = share_hidden_by_workers(finding.cost_fraction, current, workers)
    basis = (
        f"the slowest rank's data wait as far as {workers} workers per rank keep up: each loads a batch in the time "
        f"the training process did{'' if current == 0 else f' with {current} worker(s)'}, overlapped with the rest "
        "of the step"
    )
    hidden = gain(finding, share, basis)
    recs = [lever(key, workers, why, f"up to {wait:.0%} shorter steps if loading parallelizes").gaining(hidden)]
    if ctx.on_gpu and ctx.get("data.pin_memory") is False:
        why = "page-locked host batches copy to the GPU asynchronously"
        recs.append(lever("data.pin_memory", True, why, "hides the host-to-device copy"))
    if ctx.get("data.name") == "custom" or not ctx.has("data.num_workers"):
        note = no_lever("profile your datamodule's __getitem__/collate; the loader cannot be faster", "-")
        recs.append(note.gaining(gain(finding, ALL_OF_IT, "the data wait, once batches are produced in time")))
    return recs
