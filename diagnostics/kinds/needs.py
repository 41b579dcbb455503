"""What each lever needs of the run's own evidence, for every kind at once: a recommendation whose key the run
contradicts (loader workers on a host whose cores all compute, comm hooks with one rank, the optimizer of a
LightningModule that builds its own) is replaced by the reason it is not made.
"""

from __future__ import annotations

from collections.abc import Callable

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding
from diagnostics.kinds.levers import Recommendation, no_lever


def _free_cores_for_loading(ctx: RunContext, finding: Finding) -> str | None:
    """Loader workers that compute batches need cores of their own; workers that wait (I/O, a remote store) do not.
    The training thread's CPU share of its data wait tells which (unknown in older telemetry: then any busy host
    refuses, as it does once workers already run, whose CPU is not on this thread)."""
    if not ctx.host_cores_busy():
        return None
    shares = (finding.evidence.get("data_cpu_share") or {}).values()
    waiting = shares and max(shares) < CPU_BOUND_LOADING and not ctx.get("data.num_workers")
    if waiting:
        return None
    threads = ctx.num_threads or ctx.get("trainer.num_threads") or "all"
    return (
        f"every core is busy ({ctx.ranks_per_host or ctx.local_ranks()} rank(s) x {threads} thread(s) on "
        f"{ctx.cpu_count} cores) and loading computes: loader workers would take cores from the compute they feed"
    )


def _builtin_optimizer(ctx: RunContext, finding: Finding) -> str | None:
    if ctx.lightning_module:
        return "your LightningModule builds its optimizer and schedule in configure_optimizers (set them there)"
    return None


def _builtin_layers(ctx: RunContext, finding: Finding) -> str | None:
    if ctx.lightning_module:
        return "a LightningModule's submodules compile in inductor's default mode (model.compile=true), no other"
    return None


def _accumulates(ctx: RunContext, finding: Finding) -> str | None:
    if ctx.manual_optimization:
        return "your LightningModule optimizes manually, and Lightning accumulates micro-batches only for automatic"
    return None


def _several_ranks(ctx: RunContext, finding: Finding) -> str | None:
    world = ctx.batch.get("data_parallel_size")
    return "one data-parallel rank has no gradient traffic to change" if world == 1 else None


# The training thread's CPU time over its data wait above which loading is CPU work (a worker needs a free core).
CPU_BOUND_LOADING = 0.5


# What each lever needs of the run's own evidence, in one place for every finding kind: a recommendation whose key is
# here and whose need the run contradicts is not made (it is explained instead): a loader worker on a host whose
# cores all compute takes a core from the compute it feeds (benchmarks/RESULTS.md, "Figures moved from the code").
LEVER_NEEDS: dict[str, Callable[[RunContext, Finding], str | None]] = {
    "data.num_workers": _free_cores_for_loading,
    "+data.num_workers": _free_cores_for_loading,
    "strategy.comm_hook": _several_ranks,
    "strategy.bucket_cap_mb": _several_ranks,
    "optimizer": lambda ctx, f: _builtin_optimizer(ctx, f) or _several_ranks(ctx, f),  # 1-bit Adam needs peers
    "optimizer.lr": _builtin_optimizer,
    "optimizer.warmup_steps": _builtin_optimizer,
    "model.compile_mode": _builtin_layers,
    "trainer.global_batch_size": _accumulates,
}


def _not_a_lever_of_this_trainer(ctx: RunContext, key: str | None) -> str | None:
    """Why ``key`` cannot be recommended for this run: the trainer that recorded it lists its levers in run.json,
    and an override it does not list is one its config may refuse (a run dir from another version)."""
    if key is None or ctx.lever_keys is None or key.lstrip("+~") in ctx.lever_keys:
        return None
    return f"{key.lstrip('+~')} is not among the levers the trainer that recorded this run lists (run.json levers)"


def gated(recs: list[Recommendation], ctx: RunContext, finding: Finding) -> list[Recommendation]:
    """``recs`` without the levers the run's evidence rules out, each replaced by the reason it is not made, and
    without an override the run's own trainer does not list as a lever."""
    out: list[Recommendation] = []
    for rec in recs:
        if (unknown := _not_a_lever_of_this_trainer(ctx, rec.key)) is not None:
            out.append(no_lever(f"{rec.key}={rec.value} is not offered: {unknown}", "-"))
            continue
        need = LEVER_NEEDS.get(rec.key or "")
        reason = need(ctx, finding) if need is not None else None
        if reason is None:
            out.append(rec)
        else:
            out.append(no_lever(f"{rec.key}={rec.value} would not help: {reason}", "-"))
    return out
