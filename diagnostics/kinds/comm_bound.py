"""``comm_bound``: exposed communication (not hidden behind compute) is a large share of the step. Its levers
send fewer bytes (comm hooks, 1-bit Adam, ZeRO-2 instead of ZeRO-3), less often (accumulation) or over a faster
link (tensor parallelism inside a node, expert exchange).
"""

from __future__ import annotations

from typing import Any

from diagnostics.analysis.comm_split import comm_split
from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding, costed, pct
from diagnostics.analysis.finding import pct as _pct
from diagnostics.analysis.load import RunTelemetry
from diagnostics.analysis.phase_comm import timed_comm
from diagnostics.analysis.stats import ratio, rounded
from diagnostics.analysis.step_measures import collective_comm_s, exposed_comm
from diagnostics.analysis.summary import RankPhases, Summary
from diagnostics.analysis.thresholds import MIN_PHASE_S
from diagnostics.kinds.comm_levers import comm_split_of, ddp_comm_hooks, onebit_adam, tensor_parallel_levers
from diagnostics.kinds.levers import HALF, Recommendation, bigger_global, gain, lever, no_lever

# comm_bound: exposed communication (the wait at the collective that is neither data nor local compute).
# The *minimum* over ranks is used, because every rank pays true communication while only the fast ranks pay
# waiting for a straggler. A quarter of the step in exposed communication is where overlap or fewer
# all-reduces per token start to pay; below it, low_overlap reports exposed communication.
COMM_BOUND_FRACTION = 0.25
# ... or saturated: the profiled communication per step needs at least 80% of the backward compute it can hide
# behind. Gradients become ready progressively, so the last buckets always trail the backward: at 80% there
# is no headroom left and any jitter is exposed (healthy DDP runs sit well below half).
COMM_SATURATION = 0.8
# The all-to-alls are most of the phases' communication: token traffic, which neither accumulation nor gradient
# compression shrinks per token (``recommend``).
TOKENS_DOMINATE = 0.5
# The all-to-alls take at least this share of the step: fewer ranks per expert group (strategy.ep) is worth an
# A/B even while gradients are most of the traffic (a smaller ep measured faster at far less: benchmarks/RESULTS.md,
# "Figures moved from the code").
TOKENS_MATERIAL = 0.05
# comm_bound's levers by the part of the communication each shrinks (analysis/comm_split.py). Accumulation is
# offered when at least this share moves once per optimizer step: doubling it then saves a tenth of the exposed
# communication or more. Under FSDP2 (every micro-batch gathers and reduces) it saves none.
AMORTIZED_MIN = 0.2
# Under DDP the profile window's collectives stand for the gradients' (their saturation of backward, their share of a
# busy host's cores) only where the exposure it shows is within this factor of what the step records time every step.
WINDOW_AGREEMENT = 2.0
# The thresholds above, by name, for the report (report.json's ``thresholds``).
THRESHOLDS = {
    "COMM_BOUND_FRACTION": COMM_BOUND_FRACTION,
    "COMM_SATURATION": COMM_SATURATION,
    "TOKENS_DOMINATE": TOKENS_DOMINATE,
    "TOKENS_MATERIAL": TOKENS_MATERIAL,
    "AMORTIZED_MIN": AMORTIZED_MIN,
    "WINDOW_AGREEMENT": WINDOW_AGREEMENT,
}


def _saturation(p: RankPhases, comm_s: float | None) -> float | None:
    """Profiled communication per step over the backward compute it can hide behind (DDP/FSDP overlap window)."""
    if comm_s is None or p.backward_compute_s is None or p.backward_compute_s < MIN_PHASE_S:
        return None
    return comm_s / p.backward_compute_s


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


def detect(run: RunTelemetry, summary: Summary, phases: list[RankPhases]) -> list[Finding]:
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


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    """Each lever by the part of the communication it shrinks (``comm_split``): accumulation the part that moves
    once per optimizer step, a smaller tp tensor parallelism's, a smaller ep the all-to-alls'."""
    split = comm_split_of(finding, ctx)
    recs: list[Recommendation] = []
    if ctx.strategy == "megatron":
        recs += tensor_parallel_levers(finding, ctx, split)
    # An MoE run's all-to-alls move every micro-batch's tokens (measured where they were timed).
    exchange = finding.evidence.get("all_to_all") or {}
    tokens = float(exchange.get("of_phase_transfer") or 0.0)
    recs += _expert_exchange_levers(finding, ctx, exchange)
    # Without a split (a strategy whose schedule needs shapes the run did not record): gradients assumed.
    once = split.get("once_per_step")
    amortized = min(1.0 if once is None else float(once), 1.0 - tokens)
    if amortized >= AMORTIZED_MIN:
        what = "the gradients' reduction" if once is None else f"{pct(amortized)} of the communication"
        why = f"{what} moves once per optimizer step; twice the accumulation halves it per token"
        effect = "communication per token falls (the batch doubles: retune lr if needed)"
        basis = f"one step's once-only traffic ({pct(amortized)} of it) spread over twice the tokens"
        if split.get("basis"):
            basis += f"; the split from {split['basis']}"
        per_token = gain(finding, HALF * amortized, basis)
        recs += [r.gaining(per_token) for r in bigger_global(ctx, why, effect)]
    precision = ctx.get("precision.name")
    busy = bool(ctx.host_cores_busy())
    if ctx.strategy == "ddp" and onebit_adam(ctx):
        why = (
            "1-bit Adam already sends ~1/30 of the gradient bytes, from the optimizer step where no compute hides "
            "them; what is left is the exchange's own time"
        )
        recs.append(no_lever(why, "a bigger global batch (above) spreads the exchange over more tokens"))
    elif ctx.strategy == "ddp":
        recs += ddp_comm_hooks(ctx, finding)
        bucket = ctx.get("strategy.bucket_cap_mb") or 25
        why = f"fewer, larger all-reduces than {bucket} MB buckets pay the collective latency fewer times"
        recs.append(lever("strategy.bucket_cap_mb", 4 * bucket, why, "less exposed communication if latency-bound"))
        # Moving communication behind compute needs a free core (or a GPU) to run it on.
        if precision != "fp16-mixed" and not busy:  # FSDP2 here takes fp32 and bf16 policies only
            why = (
                "FSDP reduce-scatters gradients per block during backward (in bf16 if asked); it moves 1.5x DDP's "
                "bytes, so it pays when overlap, not bandwidth, is the limit"
            )
            recs.append(lever("strategy", "fsdp", why, "more communication hidden behind compute"))
    elif ctx.strategy == "fsdp":
        if precision in ("bf16-mixed", "bf16-true") and ctx.get("strategy.reduce_dtype") == "fp32":
            reduced = min(float(split.get("gradient_reduction", 1.0)), 1.0 - tokens)
            why = f"reduce-scatter gradients in bf16 instead of fp32 ({pct(reduced)} of the communication)"
            basis = f"half the gradient bytes: half of the reduce-scatters' {pct(reduced)} of the communication"
            half = gain(finding, HALF * reduced, basis)
            recs.append(lever("strategy.reduce_dtype", "bf16", why, "half the gradient bytes").gaining(half))
        if ctx.get("strategy.reshard_after_forward") is True:
            why = "keep gathered parameters from forward to backward: one all-gather per block instead of two"
            rec = lever("strategy.reshard_after_forward", False, why, "a third less traffic, more memory")
            if "gradient_reduction" in split:
                # What is not gradient reduction (or tokens) is the blocks' all-gathers, forward's and backward's
                # alike: backward's half of them goes.
                gathers = max(0.0, 1.0 - float(split["gradient_reduction"]) - tokens)
                basis = f"backward's all-gathers: half of the all-gathers' {pct(gathers)} of the communication"
                rec = rec.gaining(gain(finding, HALF * gathers, basis))
            recs.append(rec)
    elif ctx.zero3 and "gradient_reduction" in split:
        recs += zero2_lever(finding, ctx, split, tokens)
    return recs


def zero2_lever(finding: Finding, ctx: RunContext, split: dict[str, Any], tokens: float) -> list[Recommendation]:
    """ZeRO-3 gathers each module's parameters before its forward and again before its backward, every micro-batch
    (and its small "persistent" parameters after every step); ZeRO-2 keeps whole parameters and gathers the updated
    ones once per step. Costed on bytes: the gathers less the one ZeRO-2 keeps, 1/(2 x micro-batches) of them: a
    lower bound: ZeRO-3's many small calls and its per-module hooks cost host time beyond the collectives' (an A/B
    measured far more than this bound: benchmarks/RESULTS.md, "Figures moved from the code"). Not offered where the
    devices' measured headroom cannot hold the whole parameters (ZeRO-3 is often there because they do not fit)."""
    ev = finding.evidence
    dp = int(ctx.batch.get("data_parallel_size") or 1)
    precision = str(ctx.get("precision.name") or "fp32")
    width = 2 if precision.startswith(("bf16", "fp16")) else 4
    headroom, params = ev.get("device_headroom_bytes"), ev.get("num_parameters")
    if isinstance(headroom, int | float) and isinstance(params, int) and width * params * (1 - 1 / dp) > headroom:
        return []
    gathers = max(0.0, 1.0 - float(split["gradient_reduction"]) - tokens)
    micro_batches = int(ctx.batch.get("accumulation") or 1)
    saved = gathers * (1.0 - 1.0 / (2 * micro_batches))
    why = (
        f"ZeRO-3's all-gathers ({pct(gathers)} of the communication) fetch every module's parameters before its "
        "forward and again before its backward, every micro-batch; ZeRO-2 keeps whole parameters on every rank and "
        "gathers the updated ones once per step"
    )
    effect = "fewer and larger all-gathers; each rank holds whole parameters instead of a 1/dp shard"
    basis = (
        f"the all-gathers' {pct(gathers)} of the communication less the once-per-step gather ZeRO-2 keeps "
        f"(1/(2 x {micro_batches}) of their bytes); a lower bound: ZeRO-3's per-module hooks are not counted"
    )
    return [lever("strategy.stage", 2, why, effect).gaining(gain(finding, saved, basis))]


def _expert_exchange_levers(finding: Finding, ctx: RunContext, exchange: dict[str, Any]) -> list[Recommendation]:
    """Expert parallelism whose all-to-alls take a material share of the step: fewer ranks per expert group.

    Halving ep from N, each rank sends (1 - 2/N) of its tokens away instead of (1 - 1/N): 1/(N-1) less token
    traffic (all of it at N=2), and the all-to-alls' waits go with their calls.
    """
    ep = ctx.get("strategy.ep")
    share = float(exchange.get("share") or 0.0)
    if share < TOKENS_MATERIAL or not isinstance(ep, int) or ep < 2:
        return []
    tokens = float(exchange.get("of_phase_transfer") or 0.0)
    why = (
        f"the expert all-to-alls take {pct(share)} of the step ({pct(tokens)} of the phases' transfer) and move "
        f"tokens among ep={ep} ranks; with ep={ep // 2} each rank holds twice the experts, "
        + ("exchanges no tokens, " if ep == 2 else f"exchanges tokens among {ep // 2} ranks, ")
        + "and the experts' gradients join the data-parallel reduction, once per optimizer step"
    )
    effect = "token traffic halved or gone; more expert memory per rank and more gradient traffic"
    saved = share / (ep - 1)
    basis = (
        f"the all-to-alls' {pct(share)} of the step x 1/(ep-1) = {pct(saved)} (token traffic at ep={ep // 2}); "
        "the experts' added gradient traffic is not counted"
    )
    expected = {"fraction": round(min(finding.cost_fraction, saved), 4), "basis": basis}
    return [lever("strategy.ep", ep // 2, why, effect).gaining(expected)]
