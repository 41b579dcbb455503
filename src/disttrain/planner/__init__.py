"""The planner: pure predictions of memory, communication, pipeline bubble and step time for every layout.

No torch import anywhere in this package, so ``python -m plan`` answers in well under a second on a laptop.
``plan(model, hw, ...)`` ranks every candidate layout; the formulas live one job per module.
"""

import disttrain.planner.terms  # noqa: F401  (registers each strategy's terms: planner/spec.StrategyTerms)
from disttrain.planner.bubble import bubble_fraction, microbatches_in_flight
from disttrain.planner.candidates import candidate_layouts
from disttrain.planner.comm import comm_plan
from disttrain.planner.links import CommPlan, Group, LinkBytes, collective_bytes
from disttrain.planner.memory import (
    MemoryBreakdown,
    activation_bytes,
    layer_activation_bytes,
    memory_per_gpu,
    model_state_bytes,
)
from disttrain.planner.plan import JSON_KEYS, CandidatePlan, Plan, plan, plan_layout, suggest_micro_batch
from disttrain.planner.shapes import (
    ModelShape,
    ParamTensor,
    count_shape,
    hardware_flops_per_token,
    model_flops_per_token,
    model_shape,
)
from disttrain.planner.spec import Assumptions, Layout, Workload
from disttrain.planner.step_time import StepEstimate, Utilization, estimate_step, mfu_from_throughput, peak_flops

__all__ = [
    "JSON_KEYS",
    "Assumptions",
    "CandidatePlan",
    "CommPlan",
    "Group",
    "Layout",
    "LinkBytes",
    "MemoryBreakdown",
    "ModelShape",
    "ParamTensor",
    "Plan",
    "StepEstimate",
    "Utilization",
    "Workload",
    "activation_bytes",
    "bubble_fraction",
    "candidate_layouts",
    "collective_bytes",
    "comm_plan",
    "count_shape",
    "estimate_step",
    "hardware_flops_per_token",
    "layer_activation_bytes",
    "memory_per_gpu",
    "mfu_from_throughput",
    "microbatches_in_flight",
    "model_flops_per_token",
    "model_shape",
    "model_state_bytes",
    "peak_flops",
    "plan",
    "plan_layout",
    "suggest_micro_batch",
]
