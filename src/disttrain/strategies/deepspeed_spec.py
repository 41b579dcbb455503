"""strategy=deepspeed's spec: ZeRO stages 1-3 with CPU or NVMe offload (the offload checks, the NVMe swap folder)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

from disttrain.config.errors import ConfigError
from disttrain.config.hf import reference_shape
from disttrain.config.schema import RunConfig
from disttrain.config.strategy_schema import (
    OFFLOAD_DEVICES,
    DeepSpeedConfig,
    offload_device,
)
from disttrain.planner import Layout
from disttrain.planner.shapes import model_shape
from disttrain.planner.terms.deepspeed import nvme_param_buffer_elements
from disttrain.strategies.spec import StrategyBuild, StrategySpec, process_group_backend


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
