"""The planner at launch time: predict this run's memory, refuse what will not fit, resolve ``strategy=auto``.

``strategy=auto`` chooses among the layouts ``python -m train`` runs: DDP; FSDP2 full shard with or without
resharding after forward and activation checkpointing; DeepSpeed ZeRO-1/2/3 with or without activation
checkpointing; for a mixture-of-experts model FSDP2 with every expert-parallel degree ``strategy.ep`` accepts; on
GPUs also CPU offload; and every Megatron TP x PP x DP layout the planner enumerates
(``python -m plan`` shows the same candidates with their predictions); on several nodes also FSDP2 hybrid
(HSDP, one replica group per node).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from diagnostics.calibration import Calibration
from disttrain.config.degrees import validate_megatron
from disttrain.config.errors import ConfigError
from disttrain.config.experts import validate_expert_parallel, validate_megatron_experts
from disttrain.config.hf import reference_shape
from disttrain.config.schema import RunConfig, token_seq_len
from disttrain.config.strategy_schema import DDPConfig, DeepSpeedConfig, FSDPConfig, MegatronConfig, StrategyConfig
from disttrain.config.validate import BatchPlan
from disttrain.planner import Layout, MemoryBreakdown, ModelShape, Workload, memory_per_gpu, model_shape
from disttrain.planner.calibrated import assumptions_for, calibrated_profile
from disttrain.planner.candidates import megatron_layouts
from disttrain.planner.plan import DEFAULT_ASSUMPTIONS, host_memory_limit, memory_limit, plan_layout
from disttrain.planner.spec import MEGATRON_DP_TYPES
from disttrain.strategies.layout import ParallelLayout, batch_plan, layout_of, parallel_layout
from disttrain.strategies.memory_fixes import fitting_overrides

GIB = 2**30
# Relative step-time difference below which strategy=auto treats two layouts as equally fast.
AUTO_TIE = 0.01


def workload(cfg: RunConfig, batch: BatchPlan) -> Workload:
    # A LightningModule's samples are not token windows: one "token" a sample (the planner does not model it yet).
    tokens = token_seq_len(cfg.model) or 1
    return Workload(batch.micro_batch_size, batch.global_batch_size, tokens, cfg.precision.planner)


def predict_memory(cfg: RunConfig, parallel: ParallelLayout, shape: ModelShape | None = None) -> MemoryBreakdown | None:
    """Predicted peak bytes per device for this run, or None for a user model the planner cannot see into (or an
    unresolved strategy=auto). ``shape``: a measured module's (planner/footprint.py) instead of the config's."""
    if shape is None:
        reference = reference_shape(cfg.model)
        shape = model_shape(reference) if reference is not None else None
    if shape is None or parallel.mesh is None:
        return None
    work = workload(cfg, parallel.batch)
    return memory_per_gpu(shape, parallel.mesh, work, DEFAULT_ASSUMPTIONS.flash_attention)


def describe_memory(cfg: RunConfig, memory: MemoryBreakdown) -> str:
    parts = ", ".join(
        f"{name} {getattr(memory, name) / GIB:.2f}"
        for name in ("params", "grads", "optimizer_states", "activations", "buffers")
    )
    per = "per process" if cfg.hw.accelerator == "cpu" else "per GPU"
    line = f"memory       predicted {memory.total / GIB:.2f} GiB {per} ({parts} GiB)"
    limit = memory_limit(cfg.hw, DEFAULT_ASSUMPTIONS.headroom)
    if limit:
        line += f"; {'fits in' if memory.total <= limit else 'EXCEEDS'} {limit / GIB:.1f} GiB usable"
    if memory.host:
        line += f"; host (offloaded) {memory.host / GIB:.2f} GiB {per}"
        host_limit = host_memory_limit(cfg.hw, DEFAULT_ASSUMPTIONS.headroom)
        if host_limit is not None:
            line += f", {'fits in' if memory.host <= host_limit else 'EXCEEDS'} {host_limit / GIB:.1f} GiB usable"
    if memory.nvme:
        line += f"; nvme (swapped) {memory.nvme / GIB:.2f} GiB {per}"
    return line


def check_nvme_space(cfg: RunConfig, memory: MemoryBreakdown) -> None:
    """ZeRO-Infinity's swap files of every device on this node fit the free space at strategy.nvme_path (the drive
    is the node's own: each node checks its own when its ranks start; this checks the launching node's)."""
    nvme_path = getattr(cfg.strategy, "nvme_path", None)
    if not memory.nvme or not nvme_path:
        return
    path = Path(nvme_path).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), path)
    free = shutil.disk_usage(existing).free
    needed = memory.nvme * cfg.hw.devices_per_node
    if needed > free:
        raise ConfigError(
            "strategy.nvme_path",
            f"predicted {needed / GIB:.1f} GiB of swapped states per node ({memory.nvme / GIB:.1f} GiB per device "
            f"x {cfg.hw.devices_per_node}) exceeds the {free / GIB:.1f} GiB free at '{existing}'",
            "free space there, point strategy.nvme_path at a larger drive, offload less to nvme, or add "
            "check_memory=false to launch anyway",
        )


def check_fits(cfg: RunConfig, memory: MemoryBreakdown | None, check_memory: bool) -> None:
    """Refuse a run predicted not to fit its devices or, for offloaded states, its hosts' memory
    (``check_memory=false`` launches it anyway)."""
    if memory is None or not check_memory:
        return
    host_limit = host_memory_limit(cfg.hw, DEFAULT_ASSUMPTIONS.headroom)
    if host_limit is not None and memory.host > host_limit:
        raise ConfigError(
            "hw.host_memory_gib",
            f"predicted {memory.host / GIB:.1f} GiB of offloaded states per device with strategy={cfg.strategy.name}"
            f" ({memory.host * cfg.hw.devices_per_node / GIB:.1f} GiB per node) exceeds the "
            f"{host_limit * cfg.hw.devices_per_node / GIB:.1f} GiB of host memory usable on hw={cfg.hw.name}",
            "set hw.host_memory_gib to the node's real memory, offload less (strategy.offload_params=false), "
            "use more nodes, or add check_memory=false to launch anyway",
        )
    check_nvme_space(cfg, memory)
    limit = memory_limit(cfg.hw, DEFAULT_ASSUMPTIONS.headroom)
    if limit and memory.total > limit:
        fixes = fitting_overrides(cfg, batch_plan(cfg).global_batch_size, limit, predicted_memory)
        if fixes:
            same_layout = f"add {' or '.join(fixes)}, "
        else:
            states = memory.total - memory.activations
            same_layout = (
                f"no micro-batch or recomputation fits with strategy={cfg.strategy.name} (all but the activations "
                f"take {states / GIB:.1f} GiB): "
            )
        raise ConfigError(
            "strategy",
            f"predicted {memory.total / GIB:.1f} GiB per GPU with strategy={cfg.strategy.name} exceeds the "
            f"{limit / GIB:.1f} GiB usable on hw={cfg.hw.name}",
            f"{same_layout}run `python -m plan` with the same model/hw/trainer overrides for other layouts that fit "
            "(or strategy=auto), or add check_memory=false to launch anyway",
        )


def predicted_memory(cfg: RunConfig) -> MemoryBreakdown | None:
    """The launch-time prediction for a variant of a run, validated like the run itself."""
    return predict_memory(cfg, parallel_layout(cfg))


def auto_candidates(cfg: RunConfig) -> list[StrategyConfig]:
    options: list[StrategyConfig] = [DDPConfig().for_accelerator(cfg.hw.accelerator)]
    # HSDP only across nodes: within a node full sharding's all-gathers ride the fast link anyway.
    for replicas in (1, cfg.hw.num_nodes) if cfg.hw.num_nodes > 1 else (1,):
        for reshard in (True, False):
            for checkpointing in (False, True):
                option = FSDPConfig(
                    reshard_after_forward=reshard, activation_checkpointing=checkpointing, dp_replicate=replicas
                )
                options.append(option)
    options += expert_parallel_candidates(cfg)
    for stage in (1, 2, 3):
        for checkpointing in (False, True):
            options.append(DeepSpeedConfig(stage=stage, activation_checkpointing=checkpointing))
    if cfg.hw.accelerator == "gpu":
        # Offload trades step time for device memory: only worth trying together with recomputation.
        options.append(FSDPConfig(activation_checkpointing=True, cpu_offload=True))
        for stage in (1, 2, 3):
            options.append(DeepSpeedConfig(stage=stage, activation_checkpointing=True, offload_optimizer=True))
        options.append(
            DeepSpeedConfig(stage=3, activation_checkpointing=True, offload_optimizer=True, offload_params=True)
        )
    return options


def expert_parallel_candidates(cfg: RunConfig) -> list[StrategyConfig]:
    """FSDP2 with expert parallelism for an MoE model: every ``strategy.ep > 1`` that strategy=fsdp would accept
    for this run (``validate_expert_parallel``'s rules: ep divides the experts and the world), with and without
    resharding and recomputation, and on GPUs with CPU offload."""
    options: list[StrategyConfig] = []
    for ep in range(2, cfg.hw.world_size + 1):
        try:
            validate_expert_parallel(ep, cfg.model, cfg.hw.world_size)
        except ConfigError:
            continue
        for reshard in (True, False):
            for checkpointing in (False, True):
                options.append(FSDPConfig(reshard_after_forward=reshard, activation_checkpointing=checkpointing, ep=ep))
        if cfg.hw.accelerator == "gpu":  # as for FSDP2 without experts: offload only together with recomputation
            options.append(FSDPConfig(activation_checkpointing=True, cpu_offload=True, ep=ep))
    return options


def megatron_config_of(layout: Layout) -> MegatronConfig:
    """The ``strategy=megatron`` settings that run a planner layout (the inverse of ``layout_of``); ValueError for
    Megatron-LM's own data parallelism, a reference model strategy=megatron does not run."""
    if layout.dp_type not in MEGATRON_DP_TYPES:
        raise ValueError(f"strategy=megatron runs dp_type {list(MEGATRON_DP_TYPES)}, not {layout.dp_type!r}")
    return MegatronConfig(
        tp=layout.tp,
        pp=layout.pp,
        sequence_parallel=layout.sequence_parallel,
        schedule=layout.schedule if layout.pp > 1 else MegatronConfig.schedule,
        microbatches=layout.microbatches,
        virtual_stages=layout.virtual_stages,
        activation_checkpointing=layout.recompute,
        dp_type=layout.dp_type,
        # strategy.dp_replicate is read under hsdp only (replicate derives it from dp)
        dp_replicate=layout.dp_replicate if layout.dp_type == "hsdp" else MegatronConfig.dp_replicate,
    )


def megatron_candidates(cfg: RunConfig, batch: BatchPlan) -> list[tuple[MegatronConfig, Layout]]:
    """The planner's TP x PP x DP layouts for this world that also pass strategy=megatron's own checks."""
    shape = reference_shape(cfg.model)
    assert shape is not None
    world = cfg.hw.world_size
    options = []
    for layout in megatron_layouts(model_shape(shape), cfg.hw, workload(cfg, batch)):
        option = megatron_config_of(layout)
        try:
            validate_megatron_experts(option, cfg.model)
            validate_megatron(option, cfg.model, world, cfg.precision.name)
        except ConfigError:
            continue  # e.g. a vocabulary that does not split over tp
        options.append((option, layout))
    return options


def resolve_auto(
    cfg: RunConfig, parallel: ParallelLayout, calibration: Calibration | None = None, shape: ModelShape | None = None
) -> tuple[RunConfig, str]:
    """Replace ``strategy=auto`` by the fastest predicted layout that fits; returns the new config and why.

    With a ``calibration`` (``calibration=RUN_DIR``) the predictions use that run's measured matmul rate and link
    bandwidths, which is what lets auto choose on a machine without datasheet numbers (this CPU box). ``shape``: a
    user's LightningModule measured on meta (planner/footprint.py): its data-parallel layouts without recomputation
    (its activations are not measured before the launch, so recomputing them would save nothing the planner sees)."""
    ddp = dataclasses.replace(cfg, strategy=DDPConfig().for_accelerator(cfg.hw.accelerator))
    if shape is None:
        reference = reference_shape(cfg.model)
        if reference is None:
            return ddp, "a user model: the planner cannot size it, using ddp"
        shape = model_shape(reference)
    world, batch = parallel.world, parallel.batch
    work = workload(cfg, batch)
    profile = calibrated_profile(cfg.hw, calibration, cfg.precision.compute_dtype)
    assumptions = assumptions_for(profile)
    if profile.hw.peak_flops(cfg.precision.compute_dtype) is None:
        # No peak FLOP/s (this CPU box without calibration=): no step time to compare; DDP communicates least.
        return ddp, (
            f"hw={cfg.hw.name} has no peak FLOP/s (run once with diagnostics on and pass calibration=<that run> to "
            "choose by measured speeds); ddp replicas communicate least"
        )
    options = auto_candidates(cfg)
    megatron = megatron_candidates(cfg, batch) if not shape.measured_module else []
    if shape.measured_module:  # no layers to recompute or split: the data-parallel layouts as they are
        options = [o for o in options if not getattr(o, "activation_checkpointing", False)]
    if cfg.precision.fp8:  # fp8 composes with DDP and FSDP2 only (config/validate.py)
        options, megatron = [o for o in options if o.name in ("ddp", "fsdp")], []
    layouts = [(option, layout_of(option, world, batch)) for option in options]
    scored = []
    untimed: list[str] = []  # why each layout that could not be timed was left out: the choice names them
    for option, layout in [*layouts, *megatron]:
        try:
            predicted = plan_layout(shape, layout, work, profile.hw, assumptions, profile.parts)
        except ValueError as error:  # a link this layout needs has no bandwidth (datasheet or measured)
            untimed.append(str(error))
            continue
        scored.append((not predicted.fits, predicted.estimate.step_time_s, option, predicted))
    if not scored:
        return ddp, f"hw={cfg.hw.name} gives no link bandwidth to time any layout; ddp replicas communicate least"
    # Candidates come simplest first (DDP, FSDP2, DeepSpeed, Megatron); the sort is stable, step times are estimates:
    # within AUTO_TIE of the fastest, the earliest candidate wins, so a rounding-level difference never picks
    # the more complex stack.
    tie = min((item[1] for item in scored if not item[0]), default=0.0) * (1 + AUTO_TIE)
    scored.sort(key=lambda item: (item[0], max(item[1], tie)))
    unfit, step_time, chosen, predicted = scored[0]
    if unfit:
        smallest = min(scored, key=lambda item: item[3].memory.total)[3]
        raise ConfigError(
            "strategy",
            f"strategy=auto: no ddp/fsdp/deepspeed/megatron layout fits on hw={cfg.hw.name} (the smallest, "
            f"{smallest.label}, needs {smallest.memory.total / GIB:.1f} GiB per GPU)",
            "lower trainer.micro_batch_size or model.seq_len, or use more devices (see `python -m plan`)",
        )
    fitting = sum(1 for item in scored if not item[0])
    families = "ddp/fsdp/deepspeed" if shape.measured_module else "ddp/fsdp/deepspeed/megatron"
    why = (
        f"strategy=auto chose {predicted.label}: fastest predicted step ({step_time:.3g} s, "
        f"{predicted.memory.total / GIB:.1f} GiB per GPU) among {fitting} of {len(scored)} {families} layouts that fit"
    )
    if profile.measured:
        why += f" (measured speeds of {profile.calibration.source})"  # type: ignore[union-attr]
    if untimed:
        why += f"; {len(untimed)} more could not be timed ({untimed[0]})"
    if shape.measured_module:
        why += "; your module measured on meta: its states (its activations and FLOPs are not counted before launch)"
    return dataclasses.replace(cfg, strategy=chosen), why
