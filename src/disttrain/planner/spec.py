"""What the planner is asked about: a layout (how one step is split over the world), the workload, assumptions.

A ``Layout`` holds degrees and flags; what depends on the strategy that runs it (its model states, its collectives,
the parameters it steps on the GPU, its config keys and label, the degrees it accepts) is that strategy's
``StrategyTerms``, one subclass per strategy in ``planner/terms/<name>.py``, registered under its name when that
module is imported. Nothing else in the planner asks which strategy a layout names: a new strategy is a new terms
module (docs/extension.md).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from disttrain.config.hardware import HardwareProfile
from disttrain.planner.breakdown import MemoryBreakdown
from disttrain.planner.links import CommPlan, Group
from disttrain.planner.shapes import ModelShape

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("none", "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
PRECISIONS = ("fp32", "bf16-mixed", "bf16-true", "fp16-mixed")
# Megatron data parallelism: what strategy=megatron runs (``strategy.dp_type``: FSDP2 over the data-parallel ranks,
# hybrid, or replicated), and, for comparison with published figures, Megatron-LM's own DDP with and without its
# distributed optimizer (16-bit parameters and fp32 main gradients replicated; optimizer sharded or replicated).
MEGATRON_DP_TYPES = ("fsdp", "hsdp", "replicate")
MEGATRON_LM_DP_TYPES = ("distributed_optimizer", "replicated_optimizer")


@dataclass(frozen=True)
class Layout:
    """One way to train: the strategy, its parallel degrees and the options that change memory or time."""

    strategy: str  # ddp | fsdp | deepspeed | megatron
    dp: int = 1  # data-parallel degree; for FSDP hybrid it is dp_replicate x the shard group
    tp: int = 1
    pp: int = 1
    microbatches: int = 1  # micro-batches per optimizer step on each data-parallel rank (accumulation / pipeline)
    dp_replicate: int = 1  # FSDP hybrid (HSDP): replicas across nodes, parameters sharded within each
    zero_stage: int = 0  # DeepSpeed ZeRO stage 1 | 2 | 3
    offload_optimizer: bool = False  # DeepSpeed optimizer offload; FSDP cpu_offload sets both offloads
    offload_params: bool = False
    # DeepSpeed ZeRO-Infinity: the offloaded optimizer states / parameter partitions live on NVMe, not in host memory.
    nvme_optimizer: bool = False
    nvme_params: bool = False
    reshard_after_forward: bool = True  # FSDP2: free gathered parameters after forward (gather again in backward)
    recompute: str = "none"  # none | selective (Megatron: attention core) | full (whole block)
    sequence_parallel: bool = False  # Megatron: shard norms/dropout activations over tp along the sequence
    schedule: str = "none"  # pipeline schedule when pp > 1
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved 1F1B, zero-bubble V schedule)
    # Micro-batches per run of the pipeline schedule when a step runs it several times (strategy=megatron with a
    # global batch above micro x dp x strategy.microbatches); None: one run over all ``microbatches``.
    schedule_microbatches: int | None = None
    # Megatron only: one of MEGATRON_DP_TYPES (hsdp: ``dp_replicate`` replicas; replicate: dp_replicate == dp) or
    # MEGATRON_LM_DP_TYPES (a reference model, not something strategy=megatron runs).
    dp_type: str = "fsdp"
    # FSDP2 expert parallelism (``strategy.ep``): groups of ``ep`` ranks each hold every routed expert once and
    # exchange tokens by all-to-all; 1: every rank holds (its FSDP shard of) every expert.
    ep: int = 1
    # DeepSpeed ZeRO-3 (``strategy.param_persistence_threshold``): parameters of at most this many elements are not
    # partitioned for compute; every rank keeps them whole beside their partition.
    persistence_threshold: int = 100_000
    # Megatron tp > 1: the cross-entropy runs on the vocab-sharded logits (``strategy.loss_parallel``, the default),
    # reducing each token's max, sum of exponentials and target logit over the tp ranks instead of gathering logits.
    loss_parallel: bool = True
    # optimizer=onebit_adam (DDP): after its warm-up each step exchanges the momentum in 1 bit a value (an all-to-all
    # and an all-gather after backward, exposed) instead of all-reducing fp32 gradients during backward.
    onebit_adam: bool = False

    def __post_init__(self) -> None:
        terms = terms_of(self.strategy)  # options(), label() and every term below are the strategy's own
        if self.onebit_adam and not terms.runs_onebit_adam:
            raise ValueError(f"1-bit Adam runs under {_running('runs_onebit_adam')} only, not {self.strategy}")
        if self.dp_type not in MEGATRON_DP_TYPES + MEGATRON_LM_DP_TYPES:
            raise ValueError(f"unknown dp_type {self.dp_type!r}")
        if self.ep > 1 and not terms.runs_expert_parallel:
            raise ValueError(f"ep={self.ep} runs under {_running('runs_expert_parallel')} only, not {self}")
        terms.check(self)

    @property
    def terms(self) -> StrategyTerms:
        """What the planner's formulas ask of this layout's strategy (``planner/terms/<name>.py``)."""
        return terms_of(self.strategy)

    @property
    def per_schedule(self) -> int:
        """Micro-batches one pipeline schedule run holds: what sets activations in flight and the bubble."""
        return self.schedule_microbatches or self.microbatches

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def dp_shard(self) -> int:
        """The group parameters/optimizer states are sharded over (FSDP, ZeRO, Megatron's distributed optimizer)."""
        return self.dp // self.dp_replicate

    def options(self) -> dict[str, Any]:
        """The strategy's own settings, named as its config keys (``strategy.<key>``)."""
        return self.terms.options(self)

    def overrides(self) -> list[str]:
        """Hydra overrides that select this layout (keys the strategy derives itself, such as Megatron's dp, are
        given as ``auto``)."""
        items = [f"strategy={self.strategy}"]
        for key, value in self.options().items():
            if key in self.terms.derived_options:
                value = "auto"
            items.append(f"strategy.{key}={_hydra_value(value)}")
        return items

    def label(self) -> str:
        """A short human name for tables."""
        return self.terms.label(self)


def recompute_suffix(layout: Layout) -> str:
    """The part of a layout's label that names its activation recomputation."""
    return {"none": "", "selective": " +sel-recompute", "full": " +recompute"}[layout.recompute]


def _hydra_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass(frozen=True)
class Workload:
    """The batch one optimizer step trains, which every candidate layout must reproduce."""

    micro_batch_size: int  # sequences per forward/backward on one data-parallel rank
    global_batch_size: int  # sequences per optimizer step over all data-parallel ranks
    seq_len: int
    precision: str = "bf16-mixed"  # fp32 | bf16-mixed | bf16-true | fp16-mixed

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


@dataclass(frozen=True)
class Assumptions:
    """The planner's judgement calls, named so they can be checked and overridden (``conf/plan.yaml``)."""

    # Memory a layout may use is (1 - headroom) of the device's: the CUDA context (~0.5 GiB), NCCL buffers and
    # the caching allocator's fragmentation are not modelled term by term.
    headroom: float = 0.10
    # Fraction of the dense datasheet peak that large transformer matmuls sustain end to end. Well-tuned
    # Megatron runs reach ~0.5-0.55 MFU on A100/H100 (Narayanan et al. 2021 report 52% of peak on 3072 A100s
    # for the 1T model), so 0.55 is the optimistic end for compute alone; communication and bubbles come on top.
    compute_efficiency: float = 0.55
    # The same fraction of a *measured* large-matmul rate (``calibration=``). What stays unaccounted for is the
    # model's non-matmul work (attention over narrow heads, norms, activations, the loss, autograd): gpt-nano's
    # DDP step on the 2-core CPU box sustains 0.63 of its ranks' measured 512^3 matmul rate (its own GEMM shapes
    # run at 0.9-0.97 of it, so the shapes are not the gap); large-model GPU training sustains a similar
    # 0.6-0.75 of a measured large matmul. Measure yours with ``benchmarks/plan_accuracy.py``.
    calibrated_compute_efficiency: float = 0.65
    # Fraction of an overlappable compute window that actually hides communication: NCCL kernels take SMs and
    # memory bandwidth from the compute they overlap, so hiding is never complete.
    comm_overlap: float = 0.8
    # Host <-> GPU bandwidth per GPU for offload traffic, GB/s one way (PCIe Gen4 x16 sustains ~25 of 32).
    host_link_gbps: float = 25.0
    # Parameters per second the host optimizer updates for one GPU's shard under offload (a vectorised CPU
    # Adam on the cores one GPU's process gets); an order-of-magnitude figure, override it with a measurement.
    cpu_optimizer_params_per_s: float = 1.0e9
    # NVMe bandwidth of one node for ZeRO-Infinity's swaps, GB/s (shared by its devices): one PCIe Gen4 drive reads
    # ~6-7 and writes less; a node striping several drives has more. A datasheet figure, not measured here.
    nvme_gbps: float = 6.0
    # SDPA/flash attention keeps O(s) per head (q, k, v, output, logsumexp) instead of the s x s scores.
    flash_attention: bool = True


# Open/closed bounds each assumption must respect: (low, high, low inclusive).
ASSUMPTION_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "headroom": (0.0, 1.0, True),
    "compute_efficiency": (0.0, 1.0, False),
    "calibrated_compute_efficiency": (0.0, 1.0, False),
    "comm_overlap": (0.0, 1.0, True),
    "host_link_gbps": (0.0, float("inf"), False),
    "cpu_optimizer_params_per_s": (0.0, float("inf"), False),
    "nvme_gbps": (0.0, float("inf"), False),
}


def assumption_problems(assumptions: Assumptions) -> list[tuple[str, str]]:
    """(field, problem) for every assumption outside its bounds (``high`` itself is allowed except headroom)."""
    problems = []
    for f in fields(assumptions):
        if f.name not in ASSUMPTION_BOUNDS:
            continue
        low, high, low_ok = ASSUMPTION_BOUNDS[f.name]
        value = getattr(assumptions, f.name)
        above_low = value >= low if low_ok else value > low
        below_high = value < high if f.name == "headroom" else value <= high
        if not (above_low and below_high):
            span = f"{'[' if low_ok else '('}{low:g}, {high:g}{')' if f.name == 'headroom' else ']'}"
            problems.append((f.name, f"must be in {span}, got {value}"))
    return problems


_COUNT_SUFFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_parameter_count(value: Any) -> int:
    """A parameter count from 7500000000, 7.5e9 or '7.5B' (K/M/B/T suffixes); ValueError otherwise."""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", value.lower())
        if match is None:
            raise ValueError(f"cannot read {value!r} as a parameter count")
        value = float(match.group(1)) * _COUNT_SUFFIXES[match.group(2)]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1 or value != int(value):
        raise ValueError(f"expected a positive whole parameter count, got {value!r}")
    return int(value)


class StrategyTerms(ABC):
    """The planner's formulas for one strategy; a subclass registers itself under ``name`` when it is defined."""

    name: ClassVar[str]
    # Keys of ``options()`` the trainer derives from the others: ``Layout.overrides`` gives them as ``auto``.
    derived_options: ClassVar[frozenset[str]] = frozenset()
    # Lightning's mixed precision over fp32 weights (autocast): the residual stream stays fp32 and matmuls save
    # 16-bit copies of the weights for backward.
    autocast_over_fp32_weights: ClassVar[bool] = False
    # torch's AdamW steps the parameters: its states take the parameters' dtype (bf16 under bf16-true).
    optimizer_states_in_param_dtype: ClassVar[bool] = False
    runs_onebit_adam: ClassVar[bool] = False  # optimizer=onebit_adam's exchange (Layout.onebit_adam)
    runs_expert_parallel: ClassVar[bool] = False  # Layout.ep > 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # ABCMeta marks the class abstract only after this hook: a missing formula is refused here, before the class
        # could be registered and price layouts with the base's empty methods.
        super().__init_subclass__(**kwargs)
        missing = sorted(n for n in dir(cls) if getattr(getattr(cls, n, None), "__isabstractmethod__", False))
        if missing:
            raise TypeError(f"{cls.__name__} leaves abstract terms undefined: {', '.join(missing)}")
        if cls.name in _TERMS:  # a second class of the same name would silently replace the first one's formulas
            raise TypeError(
                f"{cls.__name__}: strategy {cls.name!r} has terms already ({type(_TERMS[cls.name]).__name__})"
            )
        _TERMS[cls.name] = cls()

    def check(self, layout: Layout) -> None:
        """Raise ValueError for degrees this strategy cannot run (beyond the flags above); none by default."""
        return None

    @abstractmethod
    def options(self, layout: Layout) -> dict[str, Any]:
        """The strategy's own settings, named as its config keys (``strategy.<key>``)."""

    @abstractmethod
    def label(self, layout: Layout) -> str:
        """A short human name for tables."""

    @abstractmethod
    def model_states(self, shape: ModelShape, layout: Layout, workload: Workload, stage: int) -> MemoryBreakdown:
        """Parameters, gradients, optimizer states and strategy buffers on one GPU of pipeline rank ``stage``."""

    @abstractmethod
    def comm(self, shape: ModelShape, layout: Layout, workload: Workload, groups: dict[str, Group]) -> CommPlan:
        """What the layout sends per step on one GPU, phase by phase, over ``groups`` (``comm.process_groups``)."""

    @abstractmethod
    def optimizer_parameters(self, shape: ModelShape, layout: Layout) -> int:
        """Parameters whose optimizer step runs on one GPU when nothing is offloaded."""

    def engine_host_seconds(
        self, shape: ModelShape, layout: Layout, workload: Workload, hw: HardwareProfile
    ) -> tuple[float, float]:
        """(per micro-batch, per step) host seconds the strategy's own engine adds beyond the math and collectives,
        from what calibration measured of it; none by default."""
        return 0.0, 0.0


_TERMS: dict[str, StrategyTerms] = {}


def terms_of(strategy: str) -> StrategyTerms:
    """The registered terms of ``strategy``; ValueError naming the ones there are."""
    if strategy not in _TERMS:
        raise ValueError(f"unknown strategy {strategy!r}: the planner models {', '.join(_TERMS)}")
    return _TERMS[strategy]


def planned_strategies() -> tuple[str, ...]:
    """Every strategy the planner has terms for, in registration order."""
    return tuple(_TERMS)


def _running(flag: str) -> str:
    """The strategies whose terms set ``flag``, for an error message."""
    return ", ".join(name.upper() for name, terms in _TERMS.items() if getattr(terms, flag))
