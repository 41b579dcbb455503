"""Typed config -> the objects of a run (model factory, datamodule, strategy, Trainer).

This is the only place below ``pipelines/`` where configuration becomes objects; everything it calls takes
typed arguments.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.plugins.environments import SLURMEnvironment

from diagnostics.collect.callback import DiagnosticsCallback
from diagnostics.collect.run_facts import CollectSettings, RunFacts
from diagnostics.report import diagnose_run
from disttrain.config.hf import reference_shape
from disttrain.config.objective import OBJECTIVES, split_objective
from disttrain.config.schema import (
    CustomDataConfig,
    HFModelConfig,
    LightningModuleConfig,
    LoggerConfig,
    ModelConfig,
    RunConfig,
    token_seq_len,
)
from disttrain.config.strategy_schema import DeepSpeedConfig, FSDPConfig, MegatronConfig
from disttrain.config.validate import BatchPlan
from disttrain.data.batch_check import ModuleBatchCheck, UserBatchCheck
from disttrain.data.datamodule import TokenDataModule
from disttrain.data.user_datamodule import datamodule_arguments
from disttrain.data.user_loaders import shard_user_loaders
from disttrain.launch.env import process_role
from disttrain.launch.slurm import current_task
from disttrain.models import apply_activation_checkpointing, hardware_flops_per_token
from disttrain.models.factory import Fp8Linears
from disttrain.models.facts import ModelFacts
from disttrain.models.hf_tensor_parallel import hf_tp_probe_parts
from disttrain.models.probe_parts import hf_model_parts, model_parts
from disttrain.models.targets import resolve_target
from disttrain.models.tensor_parallel import tp_probe_parts
from disttrain.reliability.callbacks import build_reliability
from disttrain.reliability.nan_guard import NonFiniteGuard
from disttrain.strategies.ddp import build_one_process
from disttrain.strategies.deepspeed_spec import with_run_swap_folder
from disttrain.strategies.fsdp_probe import fsdp_probe_parts, fsdp_probe_supported
from disttrain.strategies.layout import ParallelLayout
from disttrain.strategies.registry import spec_of
from disttrain.strategies.spec import StrategyBuild
from disttrain.strategies.zero_probe import zero_probe_parts, zero_probe_supported
from disttrain.training.callbacks import FinalValidation, Throughput
from disttrain.training.flop_count import FirstStepFlops
from disttrain.training.gc_freeze import FreezeStartupObjects
from disttrain.training.live_metrics import LiveMetrics
from disttrain.training.module_probe import module_parts
from disttrain.training.progress import build_progress
from disttrain.training.pruning import TrialPruning
from disttrain.training.step_loss import StepLoss
from disttrain.training.step_tail import step_tail, with_step_tail
from disttrain.training.wandb_sweep import run_group


def build_datamodule(cfg: RunConfig, plan: BatchPlan) -> pl.LightningDataModule:
    if isinstance(cfg.data, CustomDataConfig):
        cls = resolve_target(cfg.data.target, "data._target_")
        datamodule = cls(**datamodule_arguments(cfg.data, plan.micro_batch_size, token_seq_len(cfg.model)))  # type: ignore[operator]
        if isinstance(cfg.model, LightningModuleConfig):
            role = process_role()
            dp, seed = plan.data_parallel_size, cfg.trainer.seed
            shard_user_loaders(datamodule, role.global_rank, dp, seed, plan.global_batch_size)
        return datamodule
    data = cfg.data
    if data.pin_memory is None:  # pinned host batches let the copy to a GPU run asynchronously
        data = replace(data, pin_memory=cfg.hw.accelerator == "gpu")
    seq_len = token_seq_len(cfg.model)
    assert seq_len is not None, "a LightningModule reads its own datamodule (validated)"
    return TokenDataModule(
        data,
        seq_len,
        spec_of(cfg.strategy).loader_batch_size(plan.micro_batch_size, plan.accumulation),
        plan.global_batch_size,
        seed=cfg.trainer.seed,
    )


def build_loggers(cfg: LoggerConfig, run_dir: Path, run_name: str) -> list[Logger]:
    if cfg.name == "wandb":
        # Offline unless asked: an online run with a bad key blocks for minutes before failing.
        os.environ.setdefault("WANDB_MODE", cfg.mode)
        logger: Logger = WandbLogger(
            project=cfg.project,
            entity=cfg.entity,
            name=run_name,
            group=run_group(run_dir),  # a sweep's jobs in one group, where its report lands too
            save_dir=str(run_dir),
            offline=cfg.mode == "offline",
        )
    elif cfg.name == "tensorboard":
        logger = TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version="")
    else:
        logger = CSVLogger(save_dir=str(run_dir), name="metrics", version="")
    return [logger]


@dataclass
class TrainerParts:
    trainer: pl.Trainer
    throughput: Throughput
    ckpt_dir: Path
    nonfinite: NonFiniteGuard | None = None
    diagnostics: DiagnosticsCallback | None = None
    pruning: TrialPruning | None = None  # in a sweep with a pruner: reports val loss to the trial, may stop the run


def collectives_off_thread(cfg: RunConfig) -> bool:
    """Whether the run issues collectives off its training and autograd threads: DDP's PowerSGD hook, from gloo's
    future callbacks (the profiler window profiles every thread only then)."""
    return getattr(cfg.strategy, "comm_hook", "none") == "powersgd"


def tp_probe(cfg: RunConfig) -> Callable[..., dict] | None:
    """The TP probe's layers for a tensor-parallel run of the reference transformer (its own block and edges) or of
    an HF model (its own decoder layers inside a two-layer copy), under the run's loss_parallel; None otherwise (no
    TP, or a user's model whose layers the probe cannot build)."""
    if not isinstance(cfg.strategy, MegatronConfig) or cfg.strategy.tp < 2:
        return None
    loss_parallel = cfg.strategy.loss_parallel
    if type(cfg.model) is ModelConfig:
        parts = functools.partial(tp_probe_parts, cfg.model, loss_parallel=loss_parallel)
    elif isinstance(cfg.model, HFModelConfig):
        parts = functools.partial(hf_tp_probe_parts, cfg.model, loss_parallel=loss_parallel)
    else:
        return None
    return with_step_tail(parts, cfg.optimizer)


def fsdp_probe(cfg: RunConfig) -> Callable[..., dict] | None:
    """The FSDP probe's model for a strategy=fsdp run the probe can build as the run shards it (the reference
    transformer or an HF model, dense, in one dtype: ``fsdp_probe_supported``); None otherwise (a Linear pair
    stands in)."""
    s, model = cfg.strategy, cfg.model
    if not isinstance(s, FSDPConfig) or not fsdp_probe_supported(model, s, cfg.precision, bool(model.compile)):
        return None
    return functools.partial(fsdp_probe_parts, model, s, cfg.precision.name)


def zero_probe(cfg: RunConfig, plan: BatchPlan) -> Callable[..., dict] | None:
    """The ZeRO probe's model and engine for a strategy=deepspeed run at ZeRO-1/2 the probe can build
    (``zero_probe_supported``); None otherwise (its host work is then not modelled)."""
    s, model = cfg.strategy, cfg.model
    if not isinstance(s, DeepSpeedConfig) or not zero_probe_supported(model, s, cfg.precision, bool(model.compile)):
        return None
    clip = cfg.trainer.grad_clip
    return functools.partial(zero_probe_parts, model, s, cfg.optimizer, clip, plan.micro_batch_size, plan.accumulation)


def parts_probe(cfg: RunConfig) -> Callable[..., dict] | None:
    """The parts probe's layers (one block, the edges, the run's optimizer over a block) for a run of the reference
    transformer or an HF model, in its precision; None for a user's own model (its layers are unknown)."""
    p = cfg.precision
    fp8 = Fp8Linears(p.recipe or "tensorwise", head=p.fp8_head) if p.fp8 else None
    if type(cfg.model) is ModelConfig:
        return functools.partial(model_parts, cfg.model, cfg.optimizer, p.name, fp8=fp8)
    if isinstance(cfg.model, HFModelConfig):
        return functools.partial(hf_model_parts, cfg.model, cfg.optimizer, p.name, fp8=fp8)
    return None


def module_probe(cfg: RunConfig) -> Callable[..., dict | None] | None:
    """A user's LightningModule timed whole on a copy (training/module_probe.py) where every rank holds it whole
    (the strategy's spec says: DDP, and one process). A shard's copy would run the strategy's collectives."""
    if not isinstance(cfg.model, LightningModuleConfig) or not spec_of(cfg.strategy).ranks_hold_the_whole_module:
        return None

    def probe(module: pl.LightningModule, batch: Any, trainer: pl.Trainer) -> dict | None:
        return module_parts(module, batch, trainer.precision_plugin.train_step_context)

    return probe


def report_hang(run_dir: Path, hang: dict) -> None:
    """What the watchdog does once it declared a hang: the report, from the telemetry written so far."""
    diagnose_run(run_dir)


@dataclass(frozen=True)
class Work:
    """A run's unit of work and its accounting: tokens for a token model, samples for a LightningModule (its
    FLOPs per sample stated by the module, else ``counted`` at the first step)."""

    unit: str
    units_per_step: int
    flops: float  # model FLOPs per unit; 0.0 until counted
    counted: Callable[[], float | None] | None = None


def work_of(cfg: RunConfig, plan: BatchPlan, facts: ModelFacts, counted: FirstStepFlops | None) -> Work:
    seq_len = token_seq_len(cfg.model)
    if seq_len is not None:
        return Work("token", plan.global_batch_size * seq_len, facts.flops_per_token or 0.0)
    stated = facts.stated_flops_per_sample
    count = (lambda: counted.flops_per_sample) if counted is not None and stated is None else None
    return Work("sample", plan.global_batch_size, stated or 0.0, count)


def build_diagnostics(
    cfg: RunConfig,
    parallel: ParallelLayout,
    facts: ModelFacts,
    run_dir: Path,
    throughput: Throughput,
    counted: FirstStepFlops | None = None,
) -> DiagnosticsCallback:
    d, plan = cfg.diagnostics, parallel.batch
    settings = CollectSettings(
        step_every=d.step_every,
        gather_every=d.gather_every,
        sample_interval_s=d.sample_interval_s,
        profile=d.profile,
        profile_wait_steps=d.profile_wait_steps,
        profile_active_steps=d.profile_active_steps,
        calibrate=d.calibrate,
        hang_timeout_s=d.hang_timeout_s,
    )
    recomputes = spec_of(cfg.strategy).recomputes_activations
    shape = reference_shape(cfg.model)
    work = work_of(cfg, plan, facts, counted)
    hardware_flops = (
        hardware_flops_per_token(shape, activation_checkpointing=recomputes) if shape is not None else work.flops
    )
    run_facts = RunFacts(
        strategy=cfg.strategy.name,
        precision=cfg.precision.name,
        compute_dtype=cfg.precision.compute_dtype,
        hw=cfg.hw.name,
        num_parameters=facts.num_parameters,
        flops_per_token=work.flops,
        hardware_flops_per_token=hardware_flops,
        tokens_per_step=work.units_per_step,
        work_unit=work.unit,
        tokens_per_sample=facts.tokens_per_sample,
        counted_flops_per_unit=work.counted,
        micro_batch_size=plan.micro_batch_size,
        accumulation=plan.accumulation,
        seq_len=token_seq_len(cfg.model) or 0,
        max_steps=cfg.trainer.max_steps,
        peak_flops=cfg.hw.peak_flops(cfg.precision.compute_dtype),
        tp=parallel.tensor_parallel,
        d_model=shape.d_model if shape is not None else 0,
        tp_probe=tp_probe(cfg),
        parts_probe=parts_probe(cfg),
        collectives_off_thread=collectives_off_thread(cfg),
        fsdp_shard_ranks=parallel.fsdp_shard_ranks,
        fsdp_probe=fsdp_probe(cfg),
        step_tail=functools.partial(step_tail, optimizer=cfg.optimizer),
        zero_probe=zero_probe(cfg, plan),
        module_probe=module_probe(cfg),
    )
    return DiagnosticsCallback(
        settings, run_facts, run_dir, lambda: throughput.units_per_s, on_hang=functools.partial(report_hang, run_dir)
    )


def pruned_metric(cfg: RunConfig) -> str:
    """What a sweep job reports to its trial at each validation: the objective's metric where it is one the module
    logs, else the validation loss (the built-in model's ``val/loss``; a LightningModule's ``val_loss``)."""
    name, _ = split_objective(cfg.objective)
    if name not in OBJECTIVES:
        return name
    return "val_loss" if isinstance(cfg.model, LightningModuleConfig) else "val/loss"


def build_trainer(
    cfg: RunConfig, parallel: ParallelLayout, strategy: StrategyBuild, run_dir: Path, facts: ModelFacts
) -> TrainerParts:
    t, layout, plan = cfg.trainer, parallel.world, parallel.batch
    ckpt_dir = run_dir / "checkpoints"
    spec = spec_of(cfg.strategy)
    # Where torch clips by the global norm, the non-finite guard does it with the norm it computes anyway.
    # A module that optimizes manually clips itself (Lightning refuses gradient_clip_val for it).
    clips = bool(t.grad_clip) and facts.automatic_optimization
    guard_clips = spec.norm_clipped_by_torch and not spec.engine_runs_the_step and clips
    slurm = current_task()
    clip_norm = t.grad_clip if guard_clips else None
    reliability = build_reliability(t, ckpt_dir, clip_norm=clip_norm, preemptible=slurm is not None)
    work = work_of(cfg, plan, facts, None)
    throughput = Throughput(
        work.units_per_step,
        skip_steps=min(10, t.max_steps // 10),
        saving_s=lambda: reliability.checkpoints.save_s,
        unit=work.unit,
    )
    progress = build_progress(t.max_steps, t.log_every_n_steps, throughput)
    callbacks: list[pl.Callback] = []
    # First: a batch the model cannot read, or that is not the planned micro-batch, is refused before it runs.
    counted: FirstStepFlops | None = None
    if isinstance(cfg.model, LightningModuleConfig):
        callbacks.append(ModuleBatchCheck(plan.micro_batch_size))
        if facts.stated_flops_per_sample is None:
            counted = FirstStepFlops()
            callbacks.append(counted)
        if facts.automatic_optimization:
            callbacks.append(StepLoss(t.log_every_n_steps))
    elif isinstance(cfg.data, CustomDataConfig):
        callbacks.append(UserBatchCheck(cfg.model.seq_len, plan.micro_batch_size, cfg.model.vocab_size))
    callbacks += [*reliability.callbacks, FinalValidation(), throughput, progress, LearningRateMonitor("step")]
    diagnostics = (
        build_diagnostics(cfg, parallel, facts, run_dir, throughput, counted) if cfg.diagnostics.enabled else None
    )
    if diagnostics is not None:
        callbacks.append(diagnostics)
        reliability.guard.record = diagnostics.write  # a non-finite step shows in this rank's telemetry
        # After the diagnostics: it reads the step they just recorded, and at train end their throughput record.
        callbacks.append(LiveMetrics(t.log_every_n_steps, diagnostics, throughput, reliability.guard))
    pruning = TrialPruning(cfg.trial, process_role().is_global_zero, pruned_metric(cfg)) if cfg.trial.linked else None
    if pruning is not None:
        callbacks.append(pruning)
    callbacks.append(FreezeStartupObjects())  # after the others' train-start work: what they built is frozen too
    if reliability.preemption is not None:  # last: the step it stops at has been seen by every callback above
        callbacks.append(reliability.preemption)
    else:  # ranks are launch.py's: Lightning's hint to start them with srun (wherever srun exists) does not apply
        warnings.filterwarnings("ignore", message=r".*The `srun` command is available on your system")
    # A loader batch is a whole step's micro-batches where the strategy's engine splits them; else one micro-batch.
    batches_per_step = 1 if spec.engine_runs_the_step else plan.accumulation
    # One process needs no replica synchronisation: Lightning's single-device strategy (with the universal checkpoint).
    several = layout.world_size > 1 or spec.wraps_one_process
    trainer = pl.Trainer(
        accelerator=cfg.hw.accelerator,
        devices=layout.devices_per_node,
        num_nodes=layout.num_nodes,
        strategy=strategy.strategy if several else build_one_process(cfg.hw.accelerator, strategy.onebit),
        precision=strategy.trainer_precision,
        max_steps=t.max_steps,
        accumulate_grad_batches=batches_per_step,
        # An engine that runs the step clips by the global norm over all stages itself (manual optimization), and
        # the guard clips where torch would.
        gradient_clip_val=None if spec.engine_runs_the_step or guard_clips or not clips else t.grad_clip,
        # The train loader is endless (step-based), so validation is scheduled in loader batches.
        val_check_interval=t.val_every_n_steps * batches_per_step,
        check_val_every_n_epoch=None,
        limit_val_batches=t.val_batches,
        num_sanity_val_steps=0,
        log_every_n_steps=t.log_every_n_steps,
        deterministic=t.deterministic,
        default_root_dir=str(run_dir),
        logger=build_loggers(cfg.logger, run_dir, run_dir.name),
        enable_checkpointing=False,  # StepCheckpoint owns checkpoints (names, `last` link, final step)
        profiler=diagnostics.data_wait if diagnostics is not None else None,
        callbacks=callbacks,
        # Ranks come from SLURM; requeueing is ours (preemption.py), not Lightning's save-in-a-signal-handler.
        plugins=[SLURMEnvironment(auto_requeue=False)] if slurm is not None else None,
        use_distributed_sampler=isinstance(cfg.data, CustomDataConfig),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return TrainerParts(trainer, throughput, ckpt_dir, reliability.guard, diagnostics, pruning)


def build_run(
    cfg: RunConfig, parallel: ParallelLayout, run_dir: Path, facts: ModelFacts
) -> tuple[TrainerParts, pl.LightningModule, pl.LightningDataModule]:
    """Everything ``trainer.fit`` needs: the Trainer and its callbacks, the module, the datamodule."""
    cfg = with_run_swap_folder(cfg, run_dir)
    spec = spec_of(cfg.strategy)
    strategy = spec.build(cfg, parallel.world_size, apply_activation_checkpointing)
    module = spec.build_module(cfg, parallel.batch.accumulation, strategy, facts)
    datamodule = build_datamodule(cfg, parallel.batch)
    parts = build_trainer(cfg, parallel, strategy, run_dir, facts)
    return parts, module, datamodule
