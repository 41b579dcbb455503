"""strategy=fsdp's spec: FSDP2, parameters sharded over the data-parallel ranks (hybrid and expert parallel
included), and the wrap plan of a user's module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from disttrain.config.errors import ConfigError, require_one_of
from disttrain.config.experts import (
    validate_expert_parallel,
    validate_expert_placement,
)
from disttrain.config.schema import RunConfig
from disttrain.config.strategy_schema import (
    FSDPConfig,
)
from disttrain.planner import Layout
from disttrain.strategies.spec import StrategyBuild, StrategySpec, process_group_backend


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
