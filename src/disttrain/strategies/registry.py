"""Each strategy config class to its spec: the one table a new strategy adds itself to."""

from __future__ import annotations

from disttrain.config.schema import RunConfig
from disttrain.config.strategy_schema import (
    AutoStrategyConfig,
    DDPConfig,
    DeepSpeedConfig,
    FSDPConfig,
    MegatronConfig,
)
from disttrain.strategies.auto_spec import AutoSpec
from disttrain.strategies.ddp_spec import DDPSpec
from disttrain.strategies.deepspeed_spec import DeepSpeedSpec
from disttrain.strategies.fsdp_spec import FSDPSpec
from disttrain.strategies.megatron_spec import MegatronSpec
from disttrain.strategies.spec import StrategyBuild, StrategySpec

_SPECS: dict[type, type[StrategySpec]] = {
    DDPConfig: DDPSpec,
    FSDPConfig: FSDPSpec,
    DeepSpeedConfig: DeepSpeedSpec,
    MegatronConfig: MegatronSpec,
    AutoStrategyConfig: AutoSpec,
}


def built_strategies() -> tuple[str, ...]:
    """The names of the strategies the trainer builds (``auto`` among them: it resolves to one of the others)."""
    return tuple(spec.name for spec in _SPECS.values())


def spec_of(strategy: object) -> StrategySpec:
    """The spec of a typed ``strategy`` config."""
    return _SPECS[type(strategy)](strategy)


def build_strategy(cfg: RunConfig, world_size: int, apply_checkpointing: object) -> StrategyBuild:
    return spec_of(cfg.strategy).build(cfg, world_size, apply_checkpointing)
