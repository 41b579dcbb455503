"""The planner at launch time: predict this run's memory, refuse what will not fit, resolve ``strategy=auto``.

``strategy=auto`` chooses among the layouts ``python -m train`` can run today (DDP, and FSDP2 full shard with
or without resharding after forward, activation checkpointing and, on GPUs, CPU offload); ``python -m plan``
shows every layout, DeepSpeed and Megatron-style ones included.
"""

from __future__ import annotations

import dataclasses

from disttrain.config.errors import ConfigError
from disttrain.config.schema import DDPConfig, FSDPConfig, ModelConfig, RunConfig, StrategyConfig
from disttrain.config.validate import BatchPlan, WorldLayout
from disttrain.planner import Layout, MemoryBreakdown, Workload, memory_per_gpu, model_shape
from disttrain.planner.plan import DEFAULT_ASSUMPTIONS, memory_limit, plan_layout

GIB = 2**30


def workload(cfg: RunConfig, batch: BatchPlan) -> Workload:
    return Workload(batch.micro_batch_size, batch.global_batch_size, cfg.model.seq_len, cfg.precision.name)


def layout_of(strategy: StrategyConfig, world: WorldLayout, batch: BatchPlan) -> Layout:
    """The planner's description of a DDP or FSDP2 run."""
    if isinstance(strategy, FSDPConfig):
        return Layout(
            "fsdp",
            dp=world.data_parallel_size,
            microbatches=batch.accumulation,
            reshard_after_forward=strategy.reshard_after_forward,
            recompute="full" if strategy.activation_checkpointing else "none",
            offload_optimizer=strategy.cpu_offload,
            offload_params=strategy.cpu_offload,
        )
    return Layout("ddp", dp=world.data_parallel_size, microbatches=batch.accumulation)


def predict_memory(cfg: RunConfig, world: WorldLayout, batch: BatchPlan) -> MemoryBreakdown | None:
    """Predicted peak bytes per device for this run, or None for a user model the planner cannot see into."""
    if not isinstance(cfg.model, ModelConfig) or cfg.strategy.name == "auto":
        return None
    layout = layout_of(cfg.strategy, world, batch)
    return memory_per_gpu(model_shape(cfg.model), layout, workload(cfg, batch), DEFAULT_ASSUMPTIONS.flash_attention)


def describe_memory(cfg: RunConfig, memory: MemoryBreakdown) -> str:
    parts = ", ".join(
        f"{name} {getattr(memory, name) / GIB:.2f}"
        for name in ("params", "grads", "optimizer_states", "activations", "buffers")
    )
    per = "per process" if cfg.hw.accelerator == "cpu" else "per GPU"
    line = f"memory       predicted {memory.total / GIB:.2f} GiB {per} ({parts} GiB)"
    if cfg.hw.memory_per_device_gib:
        limit = memory_limit(cfg.hw, DEFAULT_ASSUMPTIONS.headroom)
        line += f"; {'fits in' if memory.total <= limit else 'EXCEEDS'} {limit / GIB:.1f} GiB usable"
    return line


def check_fits(cfg: RunConfig, memory: MemoryBreakdown | None, check_memory: bool) -> None:
    """Refuse a run predicted not to fit its devices (``check_memory=false`` launches it anyway)."""
    if memory is None or not check_memory or not cfg.hw.memory_per_device_gib:
        return
    limit = memory_limit(cfg.hw, DEFAULT_ASSUMPTIONS.headroom)
    if memory.total > limit:
        raise ConfigError(
            "strategy",
            f"predicted {memory.total / GIB:.1f} GiB per GPU with strategy={cfg.strategy.name} exceeds the "
            f"{limit / GIB:.1f} GiB usable on hw={cfg.hw.name}",
            "run `python -m plan` with the same model/hw/trainer overrides for layouts that fit (or "
            "strategy=auto), lower trainer.micro_batch_size, or add check_memory=false to launch anyway",
        )


def auto_candidates(cfg: RunConfig) -> list[StrategyConfig]:
    options = [DDPConfig()]
    for reshard in (True, False):
        for checkpointing in (False, True):
            options.append(FSDPConfig(reshard_after_forward=reshard, activation_checkpointing=checkpointing))
    if cfg.hw.accelerator == "gpu":
        options.append(FSDPConfig(activation_checkpointing=True, cpu_offload=True))
    return options


def resolve_auto(cfg: RunConfig, world: WorldLayout, batch: BatchPlan) -> tuple[RunConfig, str]:
    """Replace ``strategy=auto`` by the fastest predicted layout that fits; returns the new config and why."""
    if not isinstance(cfg.model, ModelConfig):
        return dataclasses.replace(cfg, strategy=DDPConfig()), "a user model: the planner cannot size it, using ddp"
    shape, work = model_shape(cfg.model), workload(cfg, batch)
    if cfg.hw.peak_flops(cfg.precision.compute_dtype) is None or not cfg.hw.memory_per_device_gib:
        # No device memory limit and no peak (this CPU box): every layout fits, and DDP communicates least.
        return dataclasses.replace(cfg, strategy=DDPConfig()), (
            f"hw={cfg.hw.name} has no device memory limit or peak FLOP/s; ddp replicas fit and communicate least"
        )
    scored = []
    for option in auto_candidates(cfg):
        predicted = plan_layout(shape, layout_of(option, world, batch), work, cfg.hw)
        scored.append((not predicted.fits, predicted.estimate.step_time_s, option, predicted))
    scored.sort(key=lambda item: (item[0], item[1]))
    unfit, step_time, chosen, predicted = scored[0]
    if unfit:
        raise ConfigError(
            "strategy",
            f"strategy=auto: no ddp/fsdp layout fits on hw={cfg.hw.name} (best needs "
            f"{predicted.memory.total / GIB:.1f} GiB per GPU)",
            "lower trainer.micro_batch_size, or see `python -m plan` for DeepSpeed/Megatron layouts",
        )
    fitting = sum(1 for item in scored if not item[0])
    why = (
        f"strategy=auto chose {predicted.label}: fastest predicted step ({step_time:.3g} s, "
        f"{predicted.memory.total / GIB:.1f} GiB per GPU) among {fitting} of {len(scored)} ddp/fsdp layouts that fit"
    )
    return dataclasses.replace(cfg, strategy=chosen), why
