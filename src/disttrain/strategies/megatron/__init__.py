"""strategy=megatron: Megatron-style tensor x pipeline x data parallelism built on torch-native parts."""

from __future__ import annotations

import torch

from disttrain.config.degrees import MegatronDegrees, megatron_degrees
from disttrain.config.schema import HFModelConfig, ModelConfig, PrecisionConfig
from disttrain.config.strategy_schema import MegatronConfig
from disttrain.strategies.megatron.engine import EngineSettings, MegatronEngine, build_mesh
from disttrain.strategies.megatron.lightning import MegatronStrategy

__all__ = ["EngineSettings", "MegatronEngine", "MegatronStrategy", "build_megatron", "build_mesh", "engine_settings"]


def engine_settings(
    cfg: MegatronConfig,
    model: ModelConfig | HFModelConfig,
    precision: PrecisionConfig,
    world_size: int,
    seed: int,
    rounds: int,
) -> EngineSettings:
    """``rounds``: pipeline rounds per optimizer step (global batch / (micro x microbatches x dp))."""
    param_dtype = torch.bfloat16 if precision.name == "bf16-mixed" else None
    return EngineSettings(model, cfg, megatron_degrees(cfg, world_size), param_dtype, seed, rounds)


def build_megatron(cfg: MegatronConfig, world_size: int, backend: str) -> tuple[MegatronStrategy, MegatronDegrees]:
    degrees = megatron_degrees(cfg, world_size)
    return MegatronStrategy(degrees, backend), degrees
