"""strategy=ddp's terms: every rank holds the whole model, its gradients and AdamW states, and all-reduces gradients
in buckets once per step (or, under optimizer=onebit_adam, exchanges the compressed momentum after backward).

Under Lightning's precision the parameters, gradients and AdamW states are fp32 (16 B/param); bf16/fp16-mixed adds
autocast's 16-bit weight copies, which matmuls save for backward.
"""

from __future__ import annotations

import math
from typing import Any

from disttrain.planner.breakdown import MemoryBreakdown
from disttrain.planner.comm import onebit_exchange_bytes
from disttrain.planner.links import CommPlan, Group, collective_bytes
from disttrain.planner.memory import autocast_copy_bytes
from disttrain.planner.shapes import ModelShape
from disttrain.planner.spec import Layout, StrategyTerms, Workload

DDP_BUCKET_BYTES = 25 * 2**20  # strategy.bucket_cap_mb's default: one all-reduce call per bucket


class DDPTerms(StrategyTerms):
    name = "ddp"
    autocast_over_fp32_weights = True
    optimizer_states_in_param_dtype = True
    runs_onebit_adam = True

    def options(self, layout: Layout) -> dict[str, Any]:
        return {}

    def label(self, layout: Layout) -> str:
        return "DDP"

    def model_states(self, shape: ModelShape, layout: Layout, workload: Workload, stage: int) -> MemoryBreakdown:
        precision = workload.precision
        p = 2 if precision == "bf16-true" else 4  # AdamW keeps its states in the parameters' dtype
        n = shape.num_parameters
        # gradient_as_bucket_view (the default on GPUs) makes DDP's buckets the gradients themselves: no extra copy.
        # torch's foreach AdamW materializes sqrt(v) for all parameters at once in the step.
        copies = autocast_copy_bytes(shape, precision)
        optimizer = round(shape.optimizer_states * p * n)
        return MemoryBreakdown(p * n, p * n, optimizer, 0, copies, step_temporaries=p * n)

    def comm(self, shape: ModelShape, layout: Layout, workload: Workload, groups: dict[str, Group]) -> CommPlan:
        if layout.onebit_adam:
            # The compressed momentum to each chunk's server (all-to-all), the servers' averages back (all-gather):
            # both after backward, inside the optimizer step, so nothing hides them.
            exchange = onebit_exchange_bytes(shape.num_parameters, layout.dp)
            dp = groups["dp"]
            return CommPlan(
                step_exposed=collective_bytes("all_to_all", exchange, dp) + collective_bytes("all_gather", exchange, dp)
            )
        grad_bytes = (2 if workload.precision == "bf16-true" else 4) * shape.num_parameters
        # Lightning skips the all-reduce on accumulation micro-batches (no_sync): once per step, one call per bucket.
        buckets = math.ceil(grad_bytes / DDP_BUCKET_BYTES)
        return CommPlan(step_bwd=collective_bytes("all_reduce", grad_bytes, groups["dp"], buckets))

    def optimizer_parameters(self, shape: ModelShape, layout: Layout) -> int:
        return shape.num_parameters
