"""``memory_pressure``: the peak is close to the device's memory. Its levers trade memory for time (smaller
micro-batches with the global batch kept, activation checkpointing, sharding, DeepSpeed offload).
"""

from __future__ import annotations

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding, cost, ranks_text
from diagnostics.analysis.load import RunTelemetry, num
from diagnostics.analysis.stats import present, ratio, rounded
from diagnostics.analysis.summary import RankPhases, Summary
from diagnostics.kinds.levers import Recommendation, lever, smaller_micro

# memory_pressure: the caching allocator above 90% of device memory fragments and retries cudaMalloc
# (visible as slow steps); above 97% the next longer sequence or larger bucket is an OOM.
MEMORY_PRESSURE_FRACTION = 0.90
MEMORY_CRITICAL_FRACTION = 0.97
# The thresholds above, by name, for the report (report.json's ``thresholds``).
THRESHOLDS = {
    "MEMORY_PRESSURE_FRACTION": MEMORY_PRESSURE_FRACTION,
    "MEMORY_CRITICAL_FRACTION": MEMORY_CRITICAL_FRACTION,
}


def _host_memory_total(run: RunTelemetry, rank: int) -> float | None:
    tele = run.ranks[rank]
    for rec in (tele.memory or {}, tele.meta or {}):
        if (total := num(rec.get("host_memory_bytes"))) is not None:
            return total
    return max(present(s.mem_total_bytes for s in tele.samples if s.source == "cpu"), default=None)


def _memory_fractions(run: RunTelemetry, phases: list[RankPhases]) -> tuple[dict[int, float], dict[int, str]]:
    fractions: dict[int, float] = {}
    basis: dict[int, str] = {}
    for p in phases:
        gpu = ratio(p.peak_reserved_bytes, p.device_memory_bytes)
        nvml = [s for s in run.ranks[p.rank].samples if s.source == "nvml"]
        sampled = present(ratio(s.mem_used_bytes, s.mem_total_bytes) for s in nvml)
        if gpu is not None or sampled:
            fractions[p.rank] = max(present([gpu, *sampled]))
            basis[p.rank] = "gpu reserved / device memory" if gpu is not None else "nvml used / total"
    # Ranks on one host share its memory: their RSS adds up against the host total.
    hosts: dict[str, list[RankPhases]] = {}
    for p in phases:
        if p.rank not in fractions and p.peak_rss_bytes is not None:
            hosts.setdefault(p.hostname or "host", []).append(p)
    for group in hosts.values():
        total = _host_memory_total(run, group[0].rank)
        if (share := ratio(sum(p.peak_rss_bytes or 0.0 for p in group), total)) is None:
            continue
        for p in group:
            fractions[p.rank] = share
            basis[p.rank] = f"sum of RSS of {len(group)} rank(s) / host memory"
    return fractions, basis


def detect(run: RunTelemetry, summary: Summary, phases: list[RankPhases]) -> list[Finding]:
    fractions, basis = _memory_fractions(run, phases)
    flagged = sorted(r for r, f in fractions.items() if f >= MEMORY_PRESSURE_FRACTION)
    if not flagged:
        return []
    worst = max(fractions[r] for r in flagged)
    by_rank = {p.rank: p for p in phases}
    evidence = {
        "memory_fraction": {r: rounded(fractions[r]) for r in flagged},
        "basis": {r: basis[r] for r in flagged},
        "peak_reserved_bytes": {r: by_rank[r].peak_reserved_bytes for r in flagged if by_rank[r].peak_reserved_bytes},
        "device_memory_bytes": {r: by_rank[r].device_memory_bytes for r in flagged if by_rank[r].device_memory_bytes},
        "peak_rss_bytes": {r: by_rank[r].peak_rss_bytes for r in flagged if by_rank[r].peak_rss_bytes},
        "threshold_fraction": MEMORY_PRESSURE_FRACTION,
    }
    # A risk, not time: nothing is lost until the OOM, which loses the run. Graded on the headroom left.
    severity = "critical" if worst >= MEMORY_CRITICAL_FRACTION else "warning"
    message = f"{ranks_text(flagged)} peak at {100 * worst:.0f}% of memory ({basis[flagged[0]]}): close to OOM"
    price = cost(0.0, "no step time lost yet: a risk of running out of memory, graded on the headroom")
    return [Finding("memory_pressure", severity, flagged, evidence, message, worst, price)]


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    headroom = {"fraction": 0.0, "basis": "memory headroom, not speed: these levers trade some step time for memory"}
    return [r.gaining(headroom) for r in _memory_levers(ctx)]


def _memory_levers(ctx: RunContext) -> list[Recommendation]:
    recs: list[Recommendation] = []
    if ctx.strategy == "fsdp" and ctx.get("strategy.activation_checkpointing") is False:
        why = "recompute each block's activations in backward instead of keeping them"
        effect = "activation memory drops to about one block's worth; ~1/3 more compute (HFU > MFU)"
        recs.append(lever("strategy.activation_checkpointing", True, why, effect))
    recs += smaller_micro(ctx)
    if ctx.strategy == "ddp" and ctx.get("precision.name") != "fp16-mixed":
        why = "DDP keeps full parameters, gradients and optimizer states on every rank; FSDP shards them over dp"
        recs.append(lever("strategy", "fsdp", why, "parameter + optimizer memory per rank divided by the dp size"))
    if ctx.strategy == "ddp":
        why = "ZeRO-2 (the default stage) shards gradients and optimizer states over dp; compute stays as in DDP"
        recs.append(lever("strategy", "deepspeed", why, "gradient + optimizer memory per rank divided by the dp size"))
    recs += _deepspeed_memory(ctx)
    if ctx.get("precision.name") == "fp32":
        recs.append(lever("precision", "bf16-mixed", "bf16 activations take half the memory", "less activation memory"))
    if ctx.strategy == "fsdp" and ctx.on_gpu and ctx.get("strategy.cpu_offload") is False:
        why = "last resort: sharded parameters and optimizer states live in host memory"
        recs.append(lever("strategy.cpu_offload", True, why, "much less GPU memory, much slower steps"))
    return recs


def _deepspeed_memory(ctx: RunContext) -> list[Recommendation]:
    """ZeRO's memory levers, cheapest first: recomputation, the next stage, then (GPU only) host offload."""
    if ctx.strategy != "deepspeed":
        return []
    recs: list[Recommendation] = []
    if ctx.get("strategy.activation_checkpointing") is False:
        why = "recompute each block's activations in backward instead of keeping them"
        effect = "activation memory drops to about one block's worth; ~1/3 more compute (HFU > MFU)"
        recs.append(lever("strategy.activation_checkpointing", True, why, effect))
    stage = ctx.get("strategy.stage")
    if stage in (1, 2):
        what = {1: "gradients", 2: "parameters"}[stage]
        why = f"ZeRO-{stage + 1} also shards the {what} over the data-parallel ranks"
        recs.append(lever("strategy.stage", stage + 1, why, f"{what} memory per rank divided by the dp size"))
    if ctx.on_gpu and ctx.get("strategy.offload_optimizer") is False:
        why = "last resort: optimizer states live in host memory and the host steps them"
        recs.append(lever("strategy.offload_optimizer", True, why, "much less GPU memory, slower steps"))
    return recs
