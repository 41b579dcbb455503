"""``low_overlap``: communication that could hide behind compute does not. Its levers change when gradients are
sent (bucket size, comm hooks); on a host whose cores all compute there is nothing to overlap with.
"""

from __future__ import annotations

from typing import Any

from diagnostics.analysis.comm_split import comm_split
from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding, costed, ranks_verb
from diagnostics.analysis.load import RunTelemetry
from diagnostics.analysis.stats import mean_lower_bound, median, ratio, rounded
from diagnostics.analysis.step_measures import collective_comm_s, exposed_comm, step_transfers
from diagnostics.analysis.summary import RankPhases, Summary
from diagnostics.kinds.comm_levers import comm_split_of, ddp_comm_hooks, onebit_adam, tensor_parallel_levers
from diagnostics.kinds.levers import ALL_OF_IT, Recommendation, gain, lever, no_lever

# low_overlap (profile window): less than 30% of communication hidden behind compute, while the exposed
# communication is at least 2% of the step (below that it is timer noise; the cost scale grades the rest). DDP
# bucketing and FSDP prefetching normally hide well over half of it.
LOW_OVERLAP_RATIO = 0.30
OVERLAP_MIN_COMM_FRACTION = 0.02
# The thresholds above, by name, for the report (report.json's ``thresholds``).
THRESHOLDS = {"LOW_OVERLAP_RATIO": LOW_OVERLAP_RATIO, "OVERLAP_MIN_COMM_FRACTION": OVERLAP_MIN_COMM_FRACTION}


def detect(run: RunTelemetry, summary: Summary, phases: list[RankPhases]) -> list[Finding]:
    """Collective communication the profile saw mostly unhidden, costed by what the whole run confirms.

    A collective is one event for all ranks: its hidden share is the ranks' median and its exposed cost the
    minimum over ranks (see collective_comm_s). The profile window is 3 steps; the whole run's step records
    (DDP: the wait after each rank's own backward) must show the same exposed time, else the windows of every
    rank must agree (FSDP, whose waits the step timer cannot separate). The cost is the smaller of the two.
    """
    comm_s = collective_comm_s(phases)
    hidden = {p.rank: h for p in phases if (h := ratio(p.profile_overlap_s or 0.0, p.profile_comm_s)) is not None}
    if comm_s is None or not hidden or (median(hidden.values()) or 0.0) >= LOW_OVERLAP_RATIO:
        return []
    steps, profile, _ = exposed_comm(run, phases)
    ranks = sorted(hidden)
    if not profile or len(profile) < len(ranks):
        return []
    window = min(profile.values())
    graded_on = None
    if len(steps) == len(ranks):
        fraction, corroborated = min(window, min(steps.values())), True
        basis = "exposed communication / step time: the smaller of the profile window and the whole run's comm wait"
        # Graded on what the steps show with confidence: a healthy run's few percent of exposed communication
        # read a point high on a noisy host is not a warning (benchmarks/diagnosis_accuracy.py, healthy-ddp).
        if (low := step_transfer_lower_bound(run)) is not None:
            graded_on = min(window, low)
    else:
        fraction, corroborated = window, len(profile) >= 2
        basis = "exposed communication / profiled step time, minimum over the ranks' profile windows"
    if fraction < OVERLAP_MIN_COMM_FRACTION:
        return []
    context = RunContext.from_run(run)
    busy = context.host_cores_busy()
    evidence: dict[str, Any] = {
        "overlap_over_comm": {r: rounded(hidden[r]) for r in ranks},
        "exposed_comm_fraction_profile": {r: rounded(f) for r, f in sorted(profile.items())},
        "exposed_comm_fraction_steps": {r: rounded(f) for r, f in sorted(steps.items())},
        "collective_comm_s_per_step": rounded(comm_s),
        "comm_by_op_s": {r: run.ranks[r].profiles[-1].comm_by_op for r in ranks if run.ranks[r].profiles},
        "host_cores_busy": busy,
        "threshold_ratio": LOW_OVERLAP_RATIO,
    }
    if (split := comm_split(run, context)) is not None:
        evidence["comm_split"] = split  # what fewer bytes would take away: a smaller tp, where it is tp's
    message = (
        f"{ranks_verb(ranks, 'hides', 'hide')} only {100 * (median(hidden.values()) or 0.0):.0f}% of "
        f"{'its' if len(ranks) == 1 else 'their'} communication behind compute: {100 * fraction:.0f}% of the step "
        "is exposed communication"
    )
    if busy:
        message += " (the compute threads fill every core: there is nothing to overlap with)"
    return [
        costed("low_overlap", ranks, evidence, message, fraction, basis, corroborated=corroborated, graded_on=graded_on)
    ]


def step_transfer_lower_bound(run: RunTelemetry) -> float | None:
    """The lower 95% bound of the mean per-step share of exposed communication (see step_transfer_fraction).

    On a shared host the share jumps from step to step (a healthy DDP run under load: median 2%, one step 41%):
    a warning must rest on more than a few such steps.
    """
    return mean_lower_bound([w / t for w, t in step_transfers(run)])


def _nothing_to_overlap_with(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    """A CPU host whose compute threads fill every core: overlap cannot help, fewer bytes can."""
    threads = f"{ctx.num_threads} thread(s)" if ctx.num_threads else "the default threads"
    ranks = ctx.ranks_per_host or ctx.local_ranks()
    why = (
        f"{ranks} rank(s) x {threads} already occupy all {ctx.cpu_count} cores of the host, so communication "
        "started earlier (smaller buckets, prefetching) would only take cores from the compute; sending fewer "
        "bytes is what shortens it"
    )
    recs = ddp_comm_hooks(ctx, finding) if ctx.strategy == "ddp" else []
    if ctx.strategy == "megatron":
        recs += tensor_parallel_levers(finding, ctx, comm_split_of(finding, ctx))
    return [*recs, no_lever(why, "overlap gains nothing on this host")]


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    if finding.evidence.get("host_cores_busy") or ctx.host_cores_busy():
        return _nothing_to_overlap_with(finding, ctx)
    hidden = gain(finding, ALL_OF_IT, "the exposed communication, hidden behind backward compute")
    return [r.gaining(hidden) if r.key else r for r in _overlap_levers(ctx)]


def _overlap_levers(ctx: RunContext) -> list[Recommendation]:
    if ctx.strategy == "ddp" and onebit_adam(ctx):
        why = "1-bit Adam's exchange runs inside the optimizer step, after backward: no bucket size moves it"
        return [no_lever(why, "a bigger global batch spreads it over more tokens")]
    if ctx.strategy == "ddp":
        bucket = ctx.get("strategy.bucket_cap_mb") or 25
        smaller = max(1, bucket // 4)
        why = (
            f"a bucket is all-reduced only when full: with {bucket} MB buckets a small model fills one bucket at the "
            f"very end of backward; {smaller} MB buckets start reducing while backward still runs"
        )
        return [lever("strategy.bucket_cap_mb", smaller, why, "communication overlapped with backward, not after it")]
    if ctx.strategy == "fsdp" and ctx.get("strategy.reshard_after_forward") is True:
        why = "backward then needs no all-gathers of its own, so only reduce-scatters remain to overlap"
        return [lever("strategy.reshard_after_forward", False, why, "shorter backward critical path, more memory")]
    if ctx.strategy == "deepspeed":
        if ctx.get("strategy.overlap_comm") is False:
            why = "DeepSpeed reduces gradient buckets only after backward unless overlap_comm is on"
            return [lever("strategy.overlap_comm", True, why, "gradient reduction overlapped with backward")]
        bucket = ctx.get("strategy.reduce_bucket_size") or 200_000_000
        why = (
            f"a gradient bucket is reduced only when {bucket:,} elements are ready: a smaller bucket starts "
            "reducing while backward still runs"
        )
        return [
            lever("strategy.reduce_bucket_size", max(1, bucket // 4), why, "communication overlapped with backward")
        ]
    tp = ctx.get("strategy.tp")
    if ctx.strategy == "megatron" and isinstance(tp, int) and tp > 1:
        why = (
            f"tensor parallelism all-reduces (or gathers and scatters) activations inside every layer, on the "
            f"critical path: tp={tp // 2} halves those collectives (the freed ranks join data parallelism)"
        )
        return [lever("strategy.tp", tp // 2, why, "fewer exposed collectives per layer, more memory per rank")]
    if ctx.strategy == "megatron":
        why = "the unhidden collectives are FSDP2's on the data-parallel axis, which prefetches as far as it can"
        return [no_lever(why, "see the per-op communication in the evidence")]
    return []
