"""``host_overhead``: the device idles while the host launches work (Python, kernel launches, per-step syncs).
Its levers amortize that time over more work per launch (larger micro-batches, compile, CUDA graphs, rarer logging).
"""

from __future__ import annotations

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding, costed, ranks_text
from diagnostics.analysis.finding import pct as _pct
from diagnostics.analysis.load import RunTelemetry
from diagnostics.analysis.stats import mean, median, ratio, rounded, steady
from diagnostics.analysis.step_measures import phase_fractions, training_samples, unexplained_idle
from diagnostics.analysis.summary import RankPhases, Summary, run_device, unattributed_s
from diagnostics.analysis.thresholds import MIN_PHASE_S
from diagnostics.kinds.levers import HALF, Recommendation, compile_levers, gain, larger_micro, lever

# host_overhead: step time that no phase accounts for (framework, Python, kernel launches), or the profiler's
# idle time. A tenth of the step is well above Lightning's per-step cost on any real model.
HOST_OVERHEAD_FRACTION = 0.10
# ... or a GPU that is mostly idle (NVML utilization) while neither data nor communication explains it.
LOW_DEVICE_UTIL_PCT = 50.0
EXPLAINED_WAIT_FRACTION = 0.10
# The thresholds above, by name, for the report (report.json's ``thresholds``).
THRESHOLDS = {
    "HOST_OVERHEAD_FRACTION": HOST_OVERHEAD_FRACTION,
    "LOW_DEVICE_UTIL_PCT": LOW_DEVICE_UTIL_PCT,
    "EXPLAINED_WAIT_FRACTION": EXPLAINED_WAIT_FRACTION,
}


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


def host_unattributed(run: RunTelemetry, phases: list[RankPhases]) -> dict[int, float]:
    """``shared_unattributed`` where host clocks time the work (CPU); nothing on a GPU (see ``run_device``)."""
    return {} if run_device(run) == "gpu" else shared_unattributed(run, phases)


def shared_unattributed(run: RunTelemetry, phases: list[RankPhases]) -> dict[int, float]:
    """Per rank, the typical step's time outside every phase that *every* rank pays, over the step time.

    Per step the minimum over ranks: a collective between steps (a preemption vote, a logging sync) holds the
    ranks that reach it first, so their unattributed time includes waiting for a slow one; the last to arrive
    waits for no one. A rank slow between steps is a straggler (slow phase: other), not host overhead of all.
    """
    if len(run.ranks) < 2:
        return phase_fractions(phases, "other_median_s")
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


def detect(run: RunTelemetry, summary: Summary, phases: list[RankPhases]) -> list[Finding]:
    # On a GPU the time outside the host-timed phases is the host waiting for queued kernels, not overhead: there only
    # the device's own idle time (the profile's kernels, NVML's utilization) says the host failed to keep it busy.
    unattributed = host_unattributed(run, phases)
    idle = {p.rank: f for p in phases if (f := unexplained_idle(p)) is not None}
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


# Per-step logging syncs the loss across ranks; every 10 steps makes that cost negligible.
LOG_EVERY_N_STEPS = 10


def _outside_phases(finding: Finding) -> bool:
    """Whether host_overhead's excess is time outside every timed phase (the step loop's own Python: hooks,
    logging, the optimizer call), which compile cannot touch, rather than idle gaps inside forward/backward."""
    ev = finding.evidence
    outside = ev.get("unattributed_fraction") or {}
    return max((float(v or 0.0) for v in outside.values()), default=0.0) >= float(ev.get("threshold_fraction") or 1.0)


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    amortized = gain(finding, HALF, "the per-step overhead spread over twice the tokens")
    larger = [r.gaining(amortized) for r in larger_micro(ctx)]
    # Outside the phases, more tokens per step amortize it (a larger micro-batch measured far ahead of compile there:
    # benchmarks/RESULTS.md, "Figures moved from the code"). Inside them, compile removes the gaps between small ops.
    recs = larger + compile_levers(ctx) if _outside_phases(finding) else compile_levers(ctx) + larger
    every = ctx.get("trainer.log_every_n_steps")
    if isinstance(every, int) and every < LOG_EVERY_N_STEPS:
        why = f"logging every {every} step(s) syncs the loss across ranks each time"
        recs.append(lever("trainer.log_every_n_steps", LOG_EVERY_N_STEPS, why, "one host sync every 10 steps"))
    return recs
