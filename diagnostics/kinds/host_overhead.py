"""``host_overhead``: the device idles while the host launches work (Python, kernel launches, per-step syncs).
Its levers amortize that time over more work per launch (larger micro-batches, compile, CUDA graphs, rarer logging).
"""

from __future__ import annotations

from diagnostics.analysis import Finding
from diagnostics.analysis.context import RunContext
from diagnostics.kinds.levers import HALF, Recommendation, compile_levers, gain, larger_micro, lever

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
    # Outside the phases, more tokens per step amortize it: a 2-layer 32-wide model on 2 CPU ranks, 10.5% outside
    # the phases: micro-batch 8 measured +75% tokens/s (3 interleaved rounds, CI +32..+133%), compile -2.9% (CI
    # -29..+33%). Inside them, compile removes the gaps between small ops.
    recs = larger + compile_levers(ctx) if _outside_phases(finding) else compile_levers(ctx) + larger
    every = ctx.get("trainer.log_every_n_steps")
    if isinstance(every, int) and every < LOG_EVERY_N_STEPS:
        why = f"logging every {every} step(s) syncs the loss across ranks each time"
        recs.append(lever("trainer.log_every_n_steps", LOG_EVERY_N_STEPS, why, "one host sync every 10 steps"))
    return recs
