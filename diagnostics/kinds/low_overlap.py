"""``low_overlap``: communication that could hide behind compute does not. Its levers change when gradients are
sent (bucket size, comm hooks); on a host whose cores all compute there is nothing to overlap with.
"""

from __future__ import annotations

from diagnostics.analysis import Finding
from diagnostics.analysis.context import RunContext
from diagnostics.kinds.comm_levers import comm_split_of, ddp_comm_hooks, onebit_adam, tensor_parallel_levers
from diagnostics.kinds.levers import ALL_OF_IT, Recommendation, gain, lever, no_lever


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
