"""Which part of a run's communication each lever can shrink.

Doubling the accumulation (a bigger global batch) halves per token only what moves once per optimizer step: DDP's
gradient all-reduce (Lightning skips it on all but the last micro-batch), ZeRO-1's reduction and all-gather, a
pipeline's tied-embedding reduction. What moves every micro-batch stays per token: FSDP2 under Lightning gathers
and reduce-scatters on every micro-batch (its strategy pauses no gradient sync), ZeRO-2 reduces every
micro-batch, tensor parallelism's activation collectives and pipeline sends carry every micro-batch's activations,
expert parallelism's all-to-alls every micro-batch's tokens. Only a smaller ``tp`` shrinks the tensor-parallel part,
and a half-precision reduction only the gradients' part.

The run's planner prediction (run.json) gives the shares for the run's own layout from its model's shapes and the
link speeds the run measured at start-up. A run the planner could not model (a user's model) falls back on the
strategy's schedule of collectives, which needs no shapes for DDP, FSDP and DeepSpeed.
"""

from __future__ import annotations

from typing import Any

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.load import RunTelemetry


def comm_split(run: RunTelemetry, context: RunContext) -> dict[str, Any] | None:
    """``{"once_per_step", "tensor_parallel", "gradient_reduction" (where known): shares, "basis": ...}`` of the
    run's communication time, or None where neither the prediction nor the strategy says. FSDP's gradient share is
    the profiled collectives' own where the window timed both kinds (``measured_reduction_share``), and so is
    ZeRO-3's, which gathers every micro-batch too."""
    split = predicted_split(run) or strategy_split(context)
    if split is None or not (context.strategy == "fsdp" or context.zero3):  # layouts that gather every micro-batch
        return split
    measured = measured_reduction_share(run)
    if measured is None:
        return split
    basis = f"{split['basis']}; gradient_reduction from the profiled all-gathers' and reductions' time"
    return {**split, "gradient_reduction": round(measured, 4), "basis": basis}


def predicted_split(run: RunTelemetry) -> dict[str, Any] | None:
    """The planner's shares for the run's own layout (run.json), or None where it made none."""
    manifest = run.manifest
    prediction = (manifest.prediction if manifest is not None else None) or {}
    shares = (prediction.get("predicted") or {}).get("comm_shares")
    if not isinstance(shares, dict) or not isinstance(shares.get("once_per_step"), int | float):
        return None
    split = {key: float(value) for key, value in shares.items() if isinstance(value, int | float)}
    split.setdefault("tensor_parallel", 0.0)
    basis = "the planner's traffic of this layout at the run's measured link speeds (run.json prediction)"
    return {**split, "basis": basis}


def collective_kind(op: str) -> str | None:
    """``gather`` or ``reduce`` for a backend's collective in the profile (gloo's ops, NCCL's kernels), None for
    anything else: the FSDP::/c10d annotations wrap those same calls and would count them twice."""
    name = op.lower()
    if not (name.startswith("gloo:") or "nccl" in name):
        return None
    if "gather" in name:
        return "gather"
    if "reduce" in name:  # reduce_scatter, all_reduce (gloo's reduce-scatter), ReduceScatter kernels
        return "reduce"
    return None


def measured_reduction_share(run: RunTelemetry) -> float | None:
    """The gradient reductions' share of the collective time in the ranks' last profiler windows, for layouts that
    gather parameters every micro-batch (FSDP, ZeRO-3): the all-gathers against the reduce-scatters. The planner
    prices each from link speeds probed at start-up, which for small calls on gloo scatter several-fold between
    runs (a 2-core 3-rank run: 0.42 and 0.79 in two runs of one command, 0.50-0.54 profiled in both)."""
    seconds = {"gather": 0.0, "reduce": 0.0}
    for tele in run.ranks.values():
        for op, spent in (tele.profiles[-1].comm_by_op if tele.profiles else {}).items():
            if (kind := collective_kind(op)) is not None:
                seconds[kind] += spent
    if seconds["gather"] <= 0 or seconds["reduce"] <= 0:
        return None
    return seconds["reduce"] / (seconds["gather"] + seconds["reduce"])


def strategy_split(context: RunContext) -> dict[str, Any] | None:
    """The split from the strategy's schedule of collectives alone (None: it depends on shapes)."""
    basis = f"strategy={context.strategy}'s collectives"
    if context.strategy == "megatron" and context.batch.get("data_parallel_size") == 1:
        # No data parallelism: nothing reduces between ranks; activations move every micro-batch.
        tp = context.get("strategy.tp")
        return {"once_per_step": 0.0, "tensor_parallel": 1.0 if isinstance(tp, int) and tp > 1 else 0.0, "basis": basis}
    once = _by_strategy(context)
    if once is None:
        return None
    split: dict[str, Any] = {"once_per_step": once, "tensor_parallel": 0.0, "basis": basis}
    if context.strategy == "ddp":
        split["gradient_reduction"] = 1.0
    elif context.strategy == "fsdp":
        split["gradient_reduction"] = _fsdp_reduction_share(context)
    return split


def _fsdp_reduction_share(context: RunContext) -> float:
    """FSDP2's reduce-scatter bytes over its all-gathers' and its own: parameters gather in the compute dtype (again
    before backward when resharded after forward), gradients reduce in ``strategy.reduce_dtype``."""
    precision = str(context.get("precision.name") or "fp32")
    gather = 2 if precision.startswith(("bf16", "fp16")) else 4
    reduce = 2 if context.get("strategy.reduce_dtype") == "bf16" or precision == "bf16-true" else 4
    gathers = 2 if context.get("strategy.reshard_after_forward") is not False else 1
    return reduce / (reduce + gathers * gather)


def _by_strategy(context: RunContext) -> float | None:
    """The once-per-step share from the strategy alone (None: it depends on shapes the run did not record)."""
    strategy = context.strategy
    if strategy == "ddp":
        return 1.0
    if strategy == "fsdp":
        return 0.0
    if strategy == "deepspeed":
        stage = context.get("strategy.stage")
        if stage in (0, 1):
            return 1.0
        if stage == 2:
            # Gradients reduce every micro-batch, the updated parameters gather once: equal bytes per call.
            accumulation = context.batch.get("accumulation") or 1
            return 1.0 / (1.0 + accumulation)
        if stage == 3:
            return 0.0
    return None
