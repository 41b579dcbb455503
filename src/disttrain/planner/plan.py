"""Predict every candidate layout and rank them: those that fit first, by predicted step time.

Layouts that do not fit follow, smallest memory first (the nearest to fitting). The recommended layout is the
first one, when it fits, with the Hydra overrides that select it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from disttrain.config.hardware import HardwareProfile
from disttrain.config.schema import ModelConfig
from disttrain.planner.candidates import candidate_layouts
from disttrain.planner.comm import comm_plan
from disttrain.planner.links import LinkBytes, comm_shares
from disttrain.planner.measured import MeasuredParts, measured_activations
from disttrain.planner.memory import MemoryBreakdown, memory_per_gpu
from disttrain.planner.shapes import ModelShape, count_shape, model_shape
from disttrain.planner.spec import Assumptions, Layout, Workload
from disttrain.planner.step_time import StepEstimate, estimate_step, peak_flops

GIB = 2**30
DEFAULT_ASSUMPTIONS = Assumptions()
JSON_KEYS = (
    "strategy",
    "options",
    "memory_bytes",
    "fits",
    "comm_bytes_per_step",
    "bubble_fraction",
    "step_time_s",
    "tokens_per_s",
    "mfu",
)


@dataclass(frozen=True)
class CandidatePlan:
    """One layout's predictions (memory per GPU, traffic per GPU and step, time) and how to select it."""

    layout: Layout
    memory: MemoryBreakdown
    fits: bool
    comm: LinkBytes
    estimate: StepEstimate
    overrides: tuple[str, ...]
    notes: tuple[str, ...] = ()
    # The traffic's shares by what can shrink them (``comm.comm_shares``): once per step, tensor parallelism's.
    comm_shares: dict[str, float] = field(default_factory=dict)

    @property
    def strategy(self) -> str:
        return self.layout.strategy

    @property
    def options(self) -> dict[str, Any]:
        return self.layout.options()

    @property
    def label(self) -> str:
        return self.layout.label()

    @property
    def bubble_fraction(self) -> float:
        return self.estimate.bubble_fraction

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s

    @property
    def tokens_per_s(self) -> float:
        return self.estimate.tokens_per_s

    @property
    def mfu(self) -> float:
        return self.estimate.mfu

    def to_json(self) -> dict[str, Any]:
        """Exactly the keys of issue 5 (``JSON_KEYS``); comm is split into intra/inter-node and total."""
        return {
            "strategy": self.strategy,
            "options": self.options,
            "memory_bytes": self.memory.to_json(),
            "fits": self.fits,
            "comm_bytes_per_step": self.comm.to_json(),
            "bubble_fraction": self.bubble_fraction,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
        }


@dataclass(frozen=True)
class Plan:
    shape: ModelShape
    hw: HardwareProfile
    workload: Workload
    assumptions: Assumptions
    memory_limit_bytes: float | None  # usable memory per GPU after headroom; None when the profile has none
    candidates: tuple[CandidatePlan, ...]  # ranked
    sequence_parallel: bool | None = True  # Megatron TP layouts planned with SP (True), without (False), both (None)
    parts: MeasuredParts | None = None  # a run's measured parts every layout's compute was composed from

    @property
    def recommended(self) -> CandidatePlan | None:
        first = self.candidates[0] if self.candidates else None
        return first if first is not None and first.fits else None

    @property
    def num_fitting(self) -> int:
        return sum(c.fits for c in self.candidates)

    def reason(self) -> str:
        """Why the recommended layout was picked (or why there is none)."""
        limit = _limit_text(self)
        if self.recommended is None:
            return f"none of the {len(self.candidates)} layouts fits {limit}"
        return f"fastest predicted step among the {self.num_fitting} of {len(self.candidates)} layouts that fit {limit}"

    def to_json(self) -> dict[str, Any]:
        best = self.recommended
        recommended = None
        if best is not None:
            recommended = {
                "strategy": best.strategy,
                "options": best.options,
                "overrides": list(best.overrides),
                "reason": self.reason(),
            }
        return {
            "model": self.shape.name,
            "unit": self.shape.unit,  # what tokens_per_s counts: a measured module's samples
            "num_parameters": self.shape.num_parameters,
            "activations_known": self.shape.known,
            "hw": self.hw.name,
            "world_size": self.hw.world_size,
            "precision": self.workload.precision,
            "micro_batch_size": self.workload.micro_batch_size,
            "global_batch_size": self.workload.global_batch_size,
            "seq_len": self.workload.seq_len,
            "memory_limit_bytes": self.memory_limit_bytes,
            "assumptions": dataclasses.asdict(self.assumptions),
            "recommended": recommended,
            "candidates": [c.to_json() for c in self.candidates],
        }


def _limit_text(result: Plan) -> str:
    if result.memory_limit_bytes is None:
        return "(no per-device memory limit in the hw profile)"
    total = result.hw.memory_per_device_gib
    usable = result.memory_limit_bytes / GIB
    return f"in {usable:.1f} GiB per GPU ({1 - result.assumptions.headroom:.0%} of {total:g} GiB)"


def memory_limit(hw: HardwareProfile, headroom: float) -> float | None:
    """Bytes a layout may use per device: the profile's memory less ``headroom``."""
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    if hw.memory_per_device_gib is None:
        return None
    return hw.memory_per_device_gib * GIB * (1.0 - headroom)


def host_memory_limit(hw: HardwareProfile, headroom: float) -> float | None:
    """Host bytes one device's offloaded states may use: the node's host memory less ``headroom``, shared by its
    devices' processes; None when the profile gives no host memory (not checked)."""
    if hw.host_memory_gib is None:
        return None
    return hw.host_memory_gib * GIB * (1.0 - headroom) / hw.devices_per_node


def host_fits(memory: MemoryBreakdown, hw: HardwareProfile, headroom: float) -> bool:
    """Whether the offloaded states of every device on a node fit its host memory (always, when not given)."""
    limit = host_memory_limit(hw, headroom)
    return limit is None or memory.host <= limit


def plan_layout(
    shape: ModelShape,
    layout: Layout,
    workload: Workload,
    hw: HardwareProfile,
    assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
    parts: MeasuredParts | None = None,
) -> CandidatePlan:
    """Predictions for one layout (its compute from ``parts`` where a run measured them, ``planner.measured``)."""
    measured = measured_activations(parts, shape, workload)
    memory = memory_per_gpu(shape, layout, workload, assumptions.flash_attention, measured)
    limit = memory_limit(hw, assumptions.headroom)
    traffic = comm_plan(shape, layout, workload, hw)
    estimate = estimate_step(shape, layout, workload, hw, traffic, assumptions, parts)
    overrides = layout.overrides()
    if layout.microbatches > 1:  # train derives global = micro x dp unless told: keep the planned batch
        overrides.append(f"trainer.global_batch_size={workload.global_batch_size}")
    notes: list[str] = []
    if not shape.known:
        notes.append("raw parameter count: activations and per-layer working buffers are unknown (0)")
    if limit is None:
        notes.append(f"hw profile '{hw.name}' gives no per-device memory: fit is not checked")
    on_host = host_fits(memory, hw, assumptions.headroom)
    if not on_host:
        usable = host_memory_limit(hw, assumptions.headroom) or 0.0
        notes.append(
            f"offloaded states need {memory.host / GIB:.1f} GiB of host memory per device, over the "
            f"{usable / GIB:.1f} GiB each of hw.devices_per_node={hw.devices_per_node} gets of hw.host_memory_gib"
        )
    return CandidatePlan(
        layout=layout,
        memory=memory,
        fits=(limit is None or memory.total <= limit) and on_host,
        comm=traffic.per_step(layout.microbatches),
        estimate=estimate,
        overrides=tuple(overrides),
        notes=tuple(notes),
        comm_shares=comm_shares(traffic, layout.microbatches, hw, assumptions.host_link_gbps),
    )


def _rank_key(candidate: CandidatePlan) -> tuple[bool, float, int]:
    if candidate.fits:
        return (False, candidate.step_time_s, candidate.memory.total)
    return (True, float(candidate.memory.total), 0)


def resolve_shape(model: ModelConfig | ModelShape | int, seq_len: int | None) -> ModelShape:
    """A ModelShape from a transformer config, a shape, or a raw parameter count (which needs ``seq_len``)."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, ModelConfig):
        return model_shape(model)
    if seq_len is None:
        raise ValueError("a raw parameter count needs seq_len")
    return count_shape(int(model), seq_len)


def plan(
    model: ModelConfig | ModelShape | int,
    hw: HardwareProfile,
    *,
    precision: str = "bf16-mixed",
    micro_batch_size: int = 1,
    global_batch_size: int | None = None,
    seq_len: int | None = None,
    assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
    sequence_parallel: bool | None = True,
    strategies: tuple[str, ...] | None = None,
    parts: MeasuredParts | None = None,
) -> Plan:
    """Predict and rank every candidate layout of ``model`` on ``hw`` (of ``strategies`` only, when given).

    ``global_batch_size`` defaults to ``micro_batch_size x world size`` (what DDP would train), and is held
    fixed across layouts; ``seq_len`` defaults to the model's. ``sequence_parallel`` picks Megatron's TP
    layouts: with it (True), without it (False) or both (None). ``parts``: a run's measured block, edges and
    optimizer step (``calibration=RUN_DIR``), which every layout's compute is composed from.
    """
    shape = resolve_shape(model, seq_len)
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    peak_flops(hw, precision)  # fail before enumerating when the profile cannot time anything
    workload = Workload(
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size or micro_batch_size * hw.world_size,
        seq_len=seq_len or shape.seq_len,
        precision=precision,
    )
    layouts = candidate_layouts(shape, hw, workload, sequence_parallel)
    if strategies is not None:
        layouts = [layout for layout in layouts if layout.strategy in strategies]
    if not layouts:
        raise ValueError(
            f"no layout of {hw.world_size} devices splits a global batch of {workload.global_batch_size} sequences "
            f"into micro-batches of {micro_batch_size}"
        )
    planned = sorted(
        (plan_layout(shape, layout, workload, hw, assumptions, parts) for layout in layouts), key=_rank_key
    )
    limit = memory_limit(hw, assumptions.headroom)
    return Plan(shape, hw, workload, assumptions, limit, tuple(planned), sequence_parallel, parts)


def suggest_micro_batch(result: Plan) -> int | None:
    """When nothing fits: the largest smaller micro-batch (same global batch) at which some layout fits."""
    w = result.workload
    micro = w.micro_batch_size // 2
    while micro >= 1:
        try:
            smaller = plan(
                result.shape,
                result.hw,
                precision=w.precision,
                micro_batch_size=micro,
                global_batch_size=w.global_batch_size,
                seq_len=w.seq_len,
                assumptions=result.assumptions,
                sequence_parallel=result.sequence_parallel,
                parts=result.parts,
            )
        except ValueError:  # this micro-batch does not split the global batch over any layout
            smaller = None
        if smaller is not None and smaller.recommended is not None:
            return micro
        micro //= 2
    return None
