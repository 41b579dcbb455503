"""What the planner is asked about: a layout (how one step is split over the world), the workload, assumptions.

A ``Layout`` is strategy-neutral on purpose: the memory, communication and time formulas read its degrees and
flags, while ``options``/``overrides`` translate it into the config keys of the strategy that runs it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

STRATEGIES = ("ddp", "fsdp", "deepspeed", "megatron")
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
        if self.strategy not in STRATEGIES:  # options(), label() and the terms would read it as another strategy
            raise ValueError(f"unknown strategy {self.strategy!r}: the planner models {', '.join(STRATEGIES)}")
        if self.onebit_adam and self.strategy != "ddp":
            raise ValueError(f"1-bit Adam runs under DDP only, not {self.strategy}")
        if self.dp_type not in MEGATRON_DP_TYPES + MEGATRON_LM_DP_TYPES:
            raise ValueError(f"unknown dp_type {self.dp_type!r}")
        if self.ep > 1 and (self.strategy != "fsdp" or self.dp_replicate > 1 or self.dp % self.ep):
            raise ValueError(f"ep={self.ep} runs under FSDP2 full shard over a world it divides, not {self}")
        expected = {"fsdp": 1, "replicate": self.dp}.get(self.dp_type)
        if self.strategy == "megatron" and expected is not None and self.dp_replicate != expected:
            raise ValueError(f"dp_type={self.dp_type} needs dp_replicate={expected}, got {self.dp_replicate}")

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
        if self.strategy == "ddp":
            return {}
        if self.strategy == "fsdp":
            options: dict[str, Any] = {
                "reshard_after_forward": self.reshard_after_forward,
                "activation_checkpointing": self.recompute == "full",
                "cpu_offload": self.offload_optimizer,
            }
            if self.dp_replicate > 1:
                options["dp_replicate"] = self.dp_replicate
            if self.ep > 1:
                options["ep"] = self.ep
            return options
        if self.strategy == "deepspeed":
            return {
                "stage": self.zero_stage,
                "offload_optimizer": _offload_value(self.offload_optimizer, self.nvme_optimizer),
                "offload_params": _offload_value(self.offload_params, self.nvme_params),
                "activation_checkpointing": self.recompute == "full",
            }
        options = {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "sequence_parallel": self.sequence_parallel,
            "activation_checkpointing": self.recompute,
        }
        if self.dp_type != "fsdp":  # the config's default
            options["dp_type"] = self.dp_type
        if not self.loss_parallel:  # the config's default is true
            options["loss_parallel"] = False
        if self.dp_type == "hsdp":
            options["dp_replicate"] = self.dp_replicate
        if self.pp > 1:  # strategy=megatron ignores the schedule without pipelining
            options["schedule"] = self.schedule
        options["microbatches"] = self.microbatches
        if self.schedule in ("interleaved_1f1b", "zero_bubble"):
            options["virtual_stages"] = self.virtual_stages
        return options

    def overrides(self) -> list[str]:
        """Hydra overrides that select this layout (Megatron's dp is derived, so it is given as ``auto``)."""
        items = [f"strategy={self.strategy}"]
        for key, value in self.options().items():
            if self.strategy == "megatron" and key == "dp":
                value = "auto"
            items.append(f"strategy.{key}={_hydra_value(value)}")
        return items

    def label(self) -> str:
        """A short human name for tables."""
        ckpt = {"none": "", "selective": " +sel-recompute", "full": " +recompute"}[self.recompute]
        if self.strategy == "ddp":
            return "DDP"
        if self.strategy == "fsdp":
            kind = f"hybrid {self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else "full shard"
            keep = "" if self.reshard_after_forward else " no-reshard"
            offload = " +cpu-offload" if self.offload_optimizer else ""
            experts = f" EP{self.ep}" if self.ep > 1 else ""
            return f"FSDP2 {kind}{experts}{keep}{offload}{ckpt}"
        if self.strategy == "deepspeed":
            offloads = (
                ("opt", self.offload_optimizer, self.nvme_optimizer),
                ("param", self.offload_params, self.nvme_params),
            )
            where = [name + ("->nvme" if nvme else "") for name, on, nvme in offloads if on]
            offload = f" +offload({','.join(where)})" if where else ""
            return f"ZeRO-{self.zero_stage}{offload}{ckpt}"
        sp = " SP" if self.sequence_parallel else ""
        schedule = ""
        if self.pp > 1:
            v = f" v{self.virtual_stages}" if self.schedule in ("interleaved_1f1b", "zero_bubble") else ""
            schedule = f" {self.schedule}{v} m{self.microbatches}"
        dp = {"fsdp": "", "hsdp": f" hsdp {self.dp_replicate}x{self.dp_shard}", "replicate": " replicated"}
        dp |= {"distributed_optimizer": " Megatron-LM dist-opt", "replicated_optimizer": " Megatron-LM DDP"}
        return f"TP{self.tp} PP{self.pp} DP{self.dp}{dp[self.dp_type]}{sp}{schedule}{ckpt}"


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


def _offload_value(on: bool, nvme: bool) -> bool | str:
    """A DeepSpeed offload option as ``strategy.offload_*`` takes it: false, true (the host) or nvme."""
    return "nvme" if on and nvme else on
