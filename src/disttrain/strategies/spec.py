"""One interface per strategy: what the rest of the pipeline asks of DDP, FSDP2, DeepSpeed or Megatron.

Validation, the data-parallel size and schedule, the planner's layout, the loader's batch size, whether blocks are
recomputed, and the Lightning objects all come from the strategy's ``StrategySpec``. The planner's memory,
communication and step-time terms still switch on the strategy's name (docs/extension.md lists every file a new
strategy touches today). Importing this module costs no torch: ``prepare()`` and
``python -m plan`` use it before anything is spawned, and the builders import their strategy's module lazily.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from disttrain.config.degrees import megatron_degrees, validate_megatron
from disttrain.config.errors import ConfigError, did_you_mean, require_one_of
from disttrain.config.experts import (
    validate_expert_parallel,
    validate_expert_placement,
    validate_megatron_experts,
)
from disttrain.config.hf import reference_shape
from disttrain.config.schema import CUDAGRAPH_MODES, HFModelConfig, LightningModuleConfig, ModelConfig, RunConfig
from disttrain.config.strategy_schema import (
    COMM_HOOKS,
    OFFLOAD_DEVICES,
    AutoStrategyConfig,
    DDPConfig,
    DeepSpeedConfig,
    FSDPConfig,
    MegatronConfig,
    offload_device,
)
from disttrain.planner import Layout
from disttrain.planner.memory import nvme_param_buffer_elements
from disttrain.planner.shapes import model_shape

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from disttrain.models.facts import ModelFacts


@dataclass(frozen=True)
class StrategyBuild:
    strategy: Any  # the Lightning Strategy
    parallelize: Callable[[Any, object], None] | None  # (model, device_mesh), in LightningModule.configure_model
    trainer_precision: str  # what the Lightning Trainer is given as `precision`
    # optimizer=onebit_adam: what DDP's hook, the optimizer and the checkpoint share (strategies/onebit.py)
    onebit: Any = None


def process_group_backend(accelerator: str) -> str:
    return "nccl" if accelerator == "gpu" else "gloo"


class StrategySpec:
    """The defaults are data parallelism over every process with Lightning's automatic optimization."""

    name: ClassVar[str]
    # The strategy's own engine runs forward/backward/step over a whole step's micro-batches (manual optimization):
    # the loader hands it one step per batch and the module clips gradients itself.
    engine_runs_the_step: ClassVar[bool] = False
    # FSDP and DeepSpeed change the model and optimizer even in one process: use them whenever asked for.
    wraps_one_process: ClassVar[bool] = True
    # Gradients are clipped by torch's clip_grad_norm_ over the optimizer's parameters (Lightning's own path), so the
    # non-finite check, which computes the same global norm, clips with it (one pass over the gradients, not two).
    norm_clipped_by_torch: ClassVar[bool] = True
    # optimizer.fused=null may pick torch's fused AdamW (models/module.py: where every parameter is on a GPU).
    fused_optimizer_ok: ClassVar[bool] = True

    def __init__(self, config: Any) -> None:
        self.config = config

    def data_parallel_size(self, world_size: int) -> int:
        return world_size

    @property
    def schedule_microbatches(self) -> int:
        """Micro-batches one pass of the strategy's schedule takes per data-parallel rank."""
        return 1

    def validate(self, cfg: RunConfig) -> None:
        """Refuse settings that cannot run (or that the library would reject late, after spawning ranks)."""

    def planner_layout(self, dp: int, accumulation: int) -> Layout:
        raise NotImplementedError

    @property
    def recomputes_activations(self) -> bool:
        """Whether each block's forward runs again in backward (hardware FLOPs count it, model FLOPs do not)."""
        return False

    def loader_batch_size(self, micro_batch_size: int, accumulation: int) -> int:
        """Samples per rank per data-loader batch."""
        return micro_batch_size * accumulation if self.engine_runs_the_step else micro_batch_size

    def build(self, cfg: RunConfig, world_size: int, apply_checkpointing: object) -> StrategyBuild:
        raise NotImplementedError

    def model_placement(self, world_size: int) -> str:
        """Where a ``model=hf`` model's starting weights are made (models/hf.py): ``whole`` on every rank; ``rank0``
        where the strategy broadcasts rank 0's parameters when it wraps the model; ``deferred`` where its plan
        materializes them sharded."""
        return "whole"

    def user_module_plan(self, cfg: RunConfig, built: StrategyBuild) -> Callable[[Any, object], None] | None:
        """What the strategy applies to a user's LightningModule in its ``configure_model`` (after the user's own):
        the plan it applies to the built-in models, which for DDP is none and for DeepSpeed partitions any module."""
        return built.parallelize

    def build_module(
        self, cfg: RunConfig, accumulation: int, built: StrategyBuild, facts: ModelFacts
    ) -> pl.LightningModule:
        if isinstance(cfg.model, LightningModuleConfig):
            from disttrain.models.user_module import build_user_module

            return build_user_module(cfg.model, self.user_module_plan(cfg, built))
        from disttrain.models.factory import Fp8Linears, build_model_factory
        from disttrain.models.module import LanguageModelModule

        fp8 = None
        if cfg.precision.fp8:
            assert cfg.precision.recipe is not None  # validated
            fp8 = Fp8Linears(cfg.precision.recipe, fsdp_all_gather=self.name == "fsdp", head=cfg.precision.fp8_head)
        optimizer = cfg.optimizer
        if optimizer.fused is None and not self.fused_optimizer_ok:
            optimizer = replace(optimizer, fused=False)
        return LanguageModelModule(
            build_model_factory(cfg.model, cfg.trainer.seed, self.model_placement(cfg.hw.world_size), fp8=fp8),
            optimizer,
            max_steps=cfg.trainer.max_steps,
            parallelize=built.parallelize,
            flops_per_token=facts.flops_per_token,
            log_every_n_steps=cfg.trainer.log_every_n_steps,
            accumulation=accumulation,
            compile_loss=bool(cfg.model.compile),  # None: off
            cudagraphs=bool(cfg.model.compile) and getattr(cfg.model, "compile_mode", None) in CUDAGRAPH_MODES,
            onebit=built.onebit,
        )


class DDPSpec(StrategySpec):
    name = "ddp"
    wraps_one_process = False  # one process needs no replica synchronisation: Lightning's single-device strategy

    def validate(self, cfg: RunConfig) -> None:
        """Bucket size and communication hook: a hook that cannot help this run is refused, not silently ignored."""
        ddp: DDPConfig = self.config
        if ddp.bucket_cap_mb <= 0:
            raise ConfigError("strategy.bucket_cap_mb", "must be > 0", "use strategy.bucket_cap_mb=25")
        if ddp.comm_hook not in COMM_HOOKS:
            raise ConfigError(
                "strategy.comm_hook",
                f"unknown hook '{ddp.comm_hook}'{did_you_mean(ddp.comm_hook, COMM_HOOKS)}",
                f"use one of {list(COMM_HOOKS)}",
            )
        if ddp.comm_hook == "none":
            return
        if cfg.hw.world_size == 1:
            raise ConfigError(
                "strategy.comm_hook",
                f"'{ddp.comm_hook}' compresses the gradient all-reduce, but a world size of 1 communicates nothing",
                "set strategy.comm_hook=none, or run more than one process (hw.devices_per_node / hw.num_nodes)",
            )
        if ddp.comm_hook in ("bf16", "fp16") and cfg.precision.name == "bf16-true":
            raise ConfigError(
                "strategy.comm_hook",
                f"under precision=bf16-true the gradients are already 2-byte bf16: the {ddp.comm_hook} hook sends "
                "the same bytes" + (" with fp16's narrower range" if ddp.comm_hook == "fp16" else ""),
                "set strategy.comm_hook=none (or powersgd to send fewer bytes)",
            )
        if ddp.comm_hook == "powersgd":
            self._validate_powersgd(cfg.trainer.max_steps)

    def _validate_powersgd(self, max_steps: int) -> None:
        ddp: DDPConfig = self.config
        if ddp.powersgd_rank < 1:
            raise ConfigError(
                "strategy.powersgd_rank", f"must be >= 1, got {ddp.powersgd_rank}", "use strategy.powersgd_rank=4"
            )
        if ddp.powersgd_warmup_steps < 2:
            # torch's PowerSGDState refuses start_powerSGD_iter <= 1 with warm start / error feedback: DDP rebuilds
            # its buckets after the first step, which would invalidate state kept per bucket.
            raise ConfigError(
                "strategy.powersgd_warmup_steps",
                f"must be >= 2 (DDP regroups its gradient buckets after the first step), got "
                f"{ddp.powersgd_warmup_steps}",
                "use strategy.powersgd_warmup_steps=2 or more",
            )
        if ddp.powersgd_warmup_steps >= max_steps:
            raise ConfigError(
                "strategy.powersgd_warmup_steps",
                f"{ddp.powersgd_warmup_steps} plain all-reduce steps leave no PowerSGD step before "
                f"trainer.max_steps={max_steps}",
                f"use strategy.powersgd_warmup_steps < {max_steps}",
            )

    def planner_layout(self, dp: int, accumulation: int) -> Layout:
        return Layout("ddp", dp=dp, microbatches=accumulation)

    def model_placement(self, world_size: int) -> str:
        # DistributedDataParallel broadcasts rank 0's parameters and buffers when it wraps the model.
        return "rank0" if world_size > 1 else "whole"

    def build(self, cfg: RunConfig, world_size: int, apply_checkpointing: object) -> StrategyBuild:
        from disttrain.strategies.ddp import build_ddp
        from disttrain.strategies.onebit import OneBitComm

        onebit = OneBitComm(cfg.optimizer.freeze_steps) if cfg.optimizer.name == "onebit_adam" else None
        backend = process_group_backend(cfg.hw.accelerator)
        return StrategyBuild(build_ddp(self.config, backend, onebit), None, cfg.precision.lightning, onebit)


class FSDPSpec(StrategySpec):
    name = "fsdp"

    def validate(self, cfg: RunConfig) -> None:
        fsdp: FSDPConfig = self.config
        require_one_of("strategy.reduce_dtype", fsdp.reduce_dtype, ("fp32", "bf16"))
        if fsdp.cpu_offload and cfg.hw.accelerator == "cpu":
            raise ConfigError(
                "strategy.cpu_offload",
                "offloading to host memory needs GPUs; on hw=cpu everything is already in host memory",
                "set strategy.cpu_offload=false, or use a GPU hw profile",
            )
        if cfg.precision.name == "fp16-mixed":
            raise ConfigError(
                "precision", "FSDP2 here supports fp32 and bf16 policies", "use precision=bf16-mixed with strategy=fsdp"
            )
        world, replicas = cfg.hw.world_size, fsdp.dp_replicate
        if replicas < 1 or world % replicas:
            ok = [d for d in range(1, world + 1) if world % d == 0]
            raise ConfigError(
                "strategy.dp_replicate",
                f"{replicas} replica groups do not divide the world size {world}",
                f"use one of {ok} (hw.num_nodes={cfg.hw.num_nodes} shards within each node)",
            )
        validate_expert_parallel(fsdp.ep, cfg.model, world)
        validate_expert_placement(fsdp.expert_placement, fsdp.ep, cfg.model)
        if fsdp.ep > 1 and replicas > 1:
            raise ConfigError(
                "strategy.ep", "expert parallelism with HSDP (strategy.dp_replicate > 1) is not built yet",
                "use strategy.dp_replicate=1 with strategy.ep",
            )  # fmt: skip

    @property
    def recomputes_activations(self) -> bool:
        return self.config.activation_checkpointing

    def planner_layout(self, dp: int, accumulation: int) -> Layout:
        fsdp: FSDPConfig = self.config
        return Layout(
            "fsdp",
            dp=dp,
            microbatches=accumulation,
            reshard_after_forward=fsdp.reshard_after_forward,
            recompute="full" if fsdp.activation_checkpointing else "none",
            offload_optimizer=fsdp.cpu_offload,
            offload_params=fsdp.cpu_offload,
            dp_replicate=fsdp.dp_replicate,
            ep=fsdp.ep,
        )

    def build(self, cfg: RunConfig, world_size: int, apply_checkpointing: object) -> StrategyBuild:
        from disttrain.strategies.fsdp import build_fsdp, trainer_precision

        backend = process_group_backend(cfg.hw.accelerator)
        strategy, plan = build_fsdp(self.config, cfg.precision, world_size, backend, apply_checkpointing)
        return StrategyBuild(strategy, plan, trainer_precision(cfg.precision))

    def model_placement(self, world_size: int) -> str:
        return "deferred"  # apply_fsdp materializes this rank's shards after fully_shard

    def user_module_plan(self, cfg: RunConfig, built: StrategyBuild) -> Callable[[Any, object], None] | None:
        from disttrain.strategies.fsdp_user import user_module_fsdp_plan

        return user_module_fsdp_plan(self.config, cfg.precision)


def validate_offload(ds: DeepSpeedConfig) -> None:
    """Offload devices, and ZeRO-Infinity's needs: stage 3 and a writable nvme_path (before any rank starts)."""
    for key in ("offload_optimizer", "offload_params"):
        device = offload_device(getattr(ds, key))
        if device is not None and device not in OFFLOAD_DEVICES:
            raise ConfigError(
                f"strategy.{key}",
                f"{getattr(ds, key)!r} is not an offload device",
                f"use strategy.{key}=cpu, nvme or false",
            )
        if device == "nvme" and ds.stage != 3:
            raise ConfigError(
                f"strategy.{key}",
                f"offload to nvme (ZeRO-Infinity) swaps ZeRO stage 3's partitions, got stage {ds.stage}",
                f"use strategy.stage=3, or strategy.{key}=cpu",
            )
    if not ds.uses_nvme:
        if ds.nvme_path is not None:
            raise ConfigError(
                "strategy.nvme_path",
                "is set but nothing is offloaded to nvme",
                "add strategy.offload_optimizer=nvme (and/or offload_params=nvme), or drop strategy.nvme_path",
            )
        return
    if not ds.nvme_path:
        raise ConfigError(
            "strategy.nvme_path",
            "offload to nvme needs a directory on a local NVMe drive to swap to",
            "add strategy.nvme_path=/local_nvme/swap (each run swaps in its own folder under it)",
        )
    path = Path(ds.nvme_path).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            "strategy.nvme_path",
            f"'{path}' cannot be created here ({existing} is not a writable directory)",
            "point strategy.nvme_path at a writable directory on a local NVMe drive",
        )


def nvme_param_buffer(cfg: RunConfig, world_size: int) -> int | None:
    """The swap buffers' size for parameter offload to NVMe from the model's shape (None: not offloading parameters
    to NVMe, or a user model whose shape the planner cannot see: DeepSpeed's default then)."""
    if not isinstance(cfg.strategy, DeepSpeedConfig) or cfg.strategy.param_offload_device != "nvme":
        return None
    shape = reference_shape(cfg.model)
    return None if shape is None else nvme_param_buffer_elements(model_shape(shape), world_size)


def nvme_swap_folder(nvme_path: str, run_dir: Path) -> Path:
    """The run's own folder under ``strategy.nvme_path``: DeepSpeed empties its swap folders when it starts, so two
    runs given one nvme_path must not share them (the name is the same on every rank of a run)."""
    digest = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]
    return Path(nvme_path).expanduser() / f"disttrain-{run_dir.name}-{digest}"


def with_run_swap_folder(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """``cfg`` with a ZeRO-Infinity run's nvme_path made its own folder (unchanged for any other run)."""
    ds = cfg.strategy
    if not isinstance(ds, DeepSpeedConfig) or not ds.uses_nvme or ds.nvme_path is None:
        return cfg
    return replace(cfg, strategy=replace(ds, nvme_path=str(nvme_swap_folder(ds.nvme_path, run_dir))))


class DeepSpeedSpec(StrategySpec):
    name = "deepspeed"
    norm_clipped_by_torch = False  # the DeepSpeed engine clips (gradient_clipping in its config)
    fused_optimizer_ok = False  # the engine steps its own flat partitions (on the host under offload)

    def validate(self, cfg: RunConfig) -> None:
        """ZeRO options that DeepSpeed itself would reject late (after spawning ranks) or that cannot run here."""
        ds: DeepSpeedConfig = self.config
        if ds.stage not in (1, 2, 3):
            raise ConfigError(
                "strategy.stage",
                f"{ds.stage} is not a ZeRO stage (1: optimizer states, 2: + gradients, 3: + parameters)",
                "use strategy.stage=1, 2 or 3 (strategy=ddp for no sharding)",
            )
        validate_offload(ds)
        for key in ("offload_optimizer", "offload_params"):
            if getattr(ds, key) and cfg.hw.accelerator == "cpu":
                raise ConfigError(
                    f"strategy.{key}",
                    "offload needs GPUs (it moves state from GPU to host memory and steps it with DeepSpeedCPUAdam, "
                    "whose C++ op is compiled at launch); on hw=cpu everything is already in host memory",
                    f"set strategy.{key}=false, or use a GPU hw profile",
                )
        if cfg.optimizer.fused:
            raise ConfigError(
                "optimizer.fused",
                "DeepSpeed steps its own partitions of the optimizer state (on the host under offload)",
                "drop optimizer.fused (it applies to strategy=ddp and strategy=fsdp)",
            )
        if ds.offload_params and ds.stage != 3:
            raise ConfigError(
                "strategy.offload_params",
                f"parameter offload needs ZeRO stage 3 (parameters are only partitioned there), got stage {ds.stage}",
                "use strategy.stage=3, or set strategy.offload_params=false",
            )
        if ds.param_persistence_threshold < 0:
            raise ConfigError(
                "strategy.param_persistence_threshold",
                f"must be >= 0 elements, got {ds.param_persistence_threshold}",
                "use strategy.param_persistence_threshold=100000 (0 partitions every parameter)",
            )
        for key in ("reduce_bucket_size", "allgather_bucket_size"):
            if getattr(ds, key) <= 0:
                raise ConfigError(
                    f"strategy.{key}", f"must be > 0 elements, got {getattr(ds, key)}", f"use strategy.{key}=200000000"
                )

    @property
    def recomputes_activations(self) -> bool:
        return self.config.activation_checkpointing

    def planner_layout(self, dp: int, accumulation: int) -> Layout:
        ds: DeepSpeedConfig = self.config
        return Layout(
            "deepspeed",
            dp=dp,
            microbatches=accumulation,
            zero_stage=ds.stage,
            offload_optimizer=ds.optimizer_offload_device is not None,
            offload_params=ds.param_offload_device is not None,
            nvme_optimizer=ds.optimizer_offload_device == "nvme",
            nvme_params=ds.param_offload_device == "nvme",
            recompute="full" if ds.activation_checkpointing else "none",
            persistence_threshold=ds.param_persistence_threshold,
        )

    def build(self, cfg: RunConfig, world_size: int, apply_checkpointing: object) -> StrategyBuild:
        # Imported here: `import deepspeed` costs seconds, and only DeepSpeed runs should pay it.
        from disttrain.strategies.deepspeed import build_deepspeed

        backend = process_group_backend(cfg.hw.accelerator)
        ds: DeepSpeedConfig = self.config
        buffer = nvme_param_buffer(cfg, world_size)
        strategy, plan = build_deepspeed(ds, cfg.trainer.micro_batch_size, backend, apply_checkpointing, buffer)  # type: ignore[arg-type]
        # Lightning turns the precision into DeepSpeed's bf16/fp16 config sections itself.
        return StrategyBuild(strategy, plan, cfg.precision.lightning)

    def model_placement(self, world_size: int) -> str:
        # ZeRO-3 materializes the model partitioned (partition_parameters); at stages 1 and 2 deepspeed.initialize
        # broadcasts rank 0's parameters, as DDP does.
        if self.config.stage == 3:
            return "deferred"
        return "rank0" if world_size > 1 else "whole"


class MegatronSpec(StrategySpec):
    name = "megatron"
    engine_runs_the_step = True
    norm_clipped_by_torch = False  # the engine clips by the norm over every stage

    def data_parallel_size(self, world_size: int) -> int:
        return megatron_degrees(self.config, world_size).dp

    @property
    def schedule_microbatches(self) -> int:
        return self.config.num_microbatches

    def validate(self, cfg: RunConfig) -> None:
        validate_megatron_experts(self.config, cfg.model)
        validate_megatron(self.config, cfg.model, cfg.hw.world_size, cfg.precision.name)

    @property
    def recomputes_activations(self) -> bool:
        return self.config.activation_checkpointing == "full"

    def planner_layout(self, dp: int, accumulation: int) -> Layout:
        m: MegatronConfig = self.config
        return Layout(
            "megatron",
            dp=dp,
            tp=m.tp,
            pp=m.pp,
            microbatches=accumulation,
            schedule_microbatches=m.num_microbatches,
            sequence_parallel=m.sequence_parallel and m.tp > 1,
            loss_parallel=m.loss_parallel,
            schedule=m.schedule if m.pp > 1 else "none",
            virtual_stages=m.virtual_stages,
            recompute=m.activation_checkpointing,
            dp_type=m.dp_type,
            dp_replicate={"fsdp": 1, "hsdp": m.dp_replicate}.get(m.dp_type, dp),
        )

    def build(self, cfg: RunConfig, world_size: int, apply_checkpointing: object) -> StrategyBuild:
        from disttrain.strategies.fsdp import trainer_precision
        from disttrain.strategies.megatron import build_megatron

        megatron, _ = build_megatron(self.config, world_size, process_group_backend(cfg.hw.accelerator))
        # The engine builds and shards the model itself (MegatronModule); FSDP2 casts under bf16-mixed.
        return StrategyBuild(megatron, None, trainer_precision(cfg.precision))

    def build_module(
        self, cfg: RunConfig, accumulation: int, built: StrategyBuild, facts: ModelFacts
    ) -> pl.LightningModule:
        from disttrain.strategies.megatron import engine_settings
        from disttrain.strategies.megatron.module import MegatronModule

        assert isinstance(cfg.model, ModelConfig | HFModelConfig)  # validated: the reference or an HF Llama
        rounds = accumulation // self.config.num_microbatches
        settings = engine_settings(self.config, cfg.model, cfg.precision, cfg.hw.world_size, cfg.trainer.seed, rounds)
        return MegatronModule(
            settings,
            cfg.optimizer,
            max_steps=cfg.trainer.max_steps,
            grad_clip=cfg.trainer.grad_clip,
            flops_per_token=facts.flops_per_token,
            log_every_n_steps=cfg.trainer.log_every_n_steps,
        )


class AutoSpec(StrategySpec):
    """``strategy=auto`` before the planner resolves it (strategies/auto.py): data parallel over every process."""

    name = "auto"

    def planner_layout(self, dp: int, accumulation: int) -> Layout:
        raise ValueError("strategy=auto has no layout until resolve_auto picks one")

    def build(self, cfg: RunConfig, world_size: int, apply_checkpointing: object) -> StrategyBuild:
        raise ValueError("strategy=auto is resolved before launch (job/prepare.py); it is never built")


_SPECS: dict[type, type[StrategySpec]] = {
    DDPConfig: DDPSpec,
    FSDPConfig: FSDPSpec,
    DeepSpeedConfig: DeepSpeedSpec,
    MegatronConfig: MegatronSpec,
    AutoStrategyConfig: AutoSpec,
}


def spec_of(strategy: object) -> StrategySpec:
    """The spec of a typed ``strategy`` config."""
    return _SPECS[type(strategy)](strategy)


def build_strategy(cfg: RunConfig, world_size: int, apply_checkpointing: object) -> StrategyBuild:
    return spec_of(cfg.strategy).build(cfg, world_size, apply_checkpointing)
