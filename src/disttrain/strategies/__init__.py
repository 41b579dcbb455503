"""One module per strategy; ``build_strategy`` picks the right one from the typed config."""

from __future__ import annotations

from dataclasses import dataclass

from lightning.pytorch.strategies import Strategy

from disttrain.config.schema import DDPConfig, DeepSpeedConfig, FSDPConfig, MegatronConfig, RunConfig
from disttrain.strategies.ddp import build_ddp
from disttrain.strategies.fsdp import build_fsdp, trainer_precision


@dataclass(frozen=True)
class StrategyBuild:
    strategy: Strategy
    parallelize: object | None  # called with (model, device_mesh) in LightningModule.configure_model
    trainer_precision: str  # what the Lightning Trainer is given as `precision`


def process_group_backend(accelerator: str) -> str:
    return "nccl" if accelerator == "gpu" else "gloo"


def build_strategy(cfg: RunConfig, world_size: int, apply_checkpointing: object) -> StrategyBuild:
    backend = process_group_backend(cfg.hw.accelerator)
    if isinstance(cfg.strategy, DeepSpeedConfig):
        # Imported here: `import deepspeed` costs seconds, and only DeepSpeed runs should pay it.
        from disttrain.strategies.deepspeed import build_deepspeed

        micro = cfg.trainer.micro_batch_size
        ds_strategy, ds_plan = build_deepspeed(cfg.strategy, micro, backend, apply_checkpointing)  # type: ignore[arg-type]
        # Lightning turns the precision into DeepSpeed's bf16/fp16 config sections itself.
        return StrategyBuild(ds_strategy, ds_plan, cfg.precision.lightning)
    if isinstance(cfg.strategy, MegatronConfig):
        from disttrain.strategies.megatron import build_megatron

        megatron, _ = build_megatron(cfg.strategy, world_size, backend)
        # The engine builds and shards the model itself (MegatronModule); FSDP2 casts under bf16-mixed.
        return StrategyBuild(megatron, None, trainer_precision(cfg.precision))
    if isinstance(cfg.strategy, FSDPConfig):
        strategy, plan = build_fsdp(cfg.strategy, cfg.precision, world_size, backend, apply_checkpointing)
        return StrategyBuild(strategy, plan, trainer_precision(cfg.precision))
    assert isinstance(cfg.strategy, DDPConfig)
    return StrategyBuild(build_ddp(cfg.strategy, backend), None, cfg.precision.lightning)
