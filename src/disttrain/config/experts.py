"""Compose-time rules of expert parallelism (pure: no torch, no processes).

``strategy.ep`` groups ``ep`` consecutive ranks; each group holds every expert once (``num_experts / ep`` per
rank) and exchanges tokens by all-to-all; ranks with the same index in different groups hold the same experts
and average their gradients (FSDP over ``world / ep`` ranks).
"""

from __future__ import annotations

from disttrain.config.errors import ConfigError
from disttrain.config.hf import hf_shape
from disttrain.config.schema import CustomModelConfig, HFModelConfig, ModelConfig


def routed_experts(model: ModelConfig | CustomModelConfig | HFModelConfig) -> int:
    """The routed experts per MoE layer of the built-in model or an HF MoE model; 0 for a dense or custom one."""
    if isinstance(model, ModelConfig):
        return model.num_experts
    if isinstance(model, HFModelConfig):
        return hf_shape(model).num_experts
    return 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_expert_parallel(ep: int, model: ModelConfig | CustomModelConfig | HFModelConfig, world_size: int) -> None:
    """Refuse an ``ep`` that cannot shard this model's experts over this world."""
    if ep < 1:
        raise ConfigError("strategy.ep", f"must be >= 1, got {ep}", "use strategy.ep=1 (no expert parallelism)")
    if ep == 1:
        return
    experts = routed_experts(model)
    if not experts:
        what = "a custom model" if isinstance(model, CustomModelConfig) else "a dense model"
        raise ConfigError(
            "strategy.ep",
            f"ep={ep} shards experts, and model={model.name} is {what} without routed experts",
            "use a mixture-of-experts model (model=moe-micro, model.num_experts=8, or an HF Mixtral/Qwen2-MoE/OLMoE)"
            " or strategy.ep=1",
        )
    if world_size % ep:
        raise ConfigError(
            "strategy.ep",
            f"ep={ep} does not divide the world size {world_size}",
            f"use a divisor of {world_size}: {_divisors(world_size)}",
        )
    if experts % ep:
        ok = [d for d in _divisors(experts) if world_size % d == 0]
        raise ConfigError(
            "strategy.ep",
            f"model {model.name}'s {experts} experts cannot be split evenly over ep={ep} ranks",
            f"use an ep dividing both the experts and the world size: {ok}",
        )


def refuse_moe(strategy: str, model: ModelConfig | CustomModelConfig | HFModelConfig) -> None:
    """Strategies whose parallel plans do not know the MoE layer yet."""
    experts = routed_experts(model)
    if experts:
        raise ConfigError(
            "strategy",
            f"strategy={strategy} has no plan for mixture-of-experts layers yet"
            f" (model={model.name}: {experts} experts)",
            "use strategy=fsdp (with strategy.ep=... for expert parallelism) or strategy=ddp",
        )
