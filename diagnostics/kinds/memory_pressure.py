"""``memory_pressure``: the peak is close to the device's memory. Its levers trade memory for time (smaller
micro-batches with the global batch kept, activation checkpointing, sharding, DeepSpeed offload).
"""

from __future__ import annotations

from diagnostics.analysis import Finding
from diagnostics.analysis.context import RunContext
from diagnostics.kinds.levers import Recommendation, lever, smaller_micro


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
