"""``low_mfu``: the model FLOPs reached are a small share of the device's peak and no other finding explains it.
Its levers give the device more work per launch.
"""

from __future__ import annotations

from diagnostics.analysis import Finding
from diagnostics.analysis.context import RunContext
from diagnostics.kinds.levers import Recommendation, compile_levers, larger_micro, lever


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    recs: list[Recommendation] = []
    if ctx.on_gpu and ctx.get("precision.name") == "fp32":
        why = "fp32 matmuls run far below the tensor-core bf16 peak that MFU is measured against"
        recs.append(lever("precision", "bf16-mixed", why, "several times the matmul throughput"))
    return recs + compile_levers(ctx) + larger_micro(ctx)
