"""strategy=megatron's spec: tensor, pipeline and data parallelism over the reference transformer or an HF model
with a parallel plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

from disttrain.config.degrees import megatron_degrees, validate_megatron
from disttrain.config.experts import (
    validate_megatron_experts,
)
from disttrain.config.schema import HFModelConfig, ModelConfig, RunConfig
from disttrain.config.strategy_schema import (
    MegatronConfig,
)
from disttrain.planner import Layout
from disttrain.strategies.spec import StrategyBuild, StrategySpec, process_group_backend

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from disttrain.models.facts import ModelFacts


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
