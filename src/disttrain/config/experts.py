"""Compose-time rules of expert parallelism (pure: no torch, no processes).

``strategy.ep`` groups ``ep`` consecutive ranks; each group holds every expert once (``num_experts / ep`` per
rank) and exchanges tokens by all-to-all; ranks with the same index in different groups hold the same experts
and average their gradients (FSDP over ``world / ep`` ranks).
"""

from __future__ import annotations

from disttrain.config.errors import ConfigError
from disttrain.config.hf import hf_shape
from disttrain.config.schema import AnyModelConfig, CustomModelConfig, HFModelConfig, ModelConfig
from disttrain.config.strategy_schema import MegatronConfig


def routed_experts(model: AnyModelConfig) -> int:
    """The routed experts per MoE layer of the built-in model or an HF MoE model; 0 for a dense or custom one."""
    if isinstance(model, ModelConfig):
        return model.num_experts
    if isinstance(model, HFModelConfig):
        return hf_shape(model).num_experts
    return 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_expert_parallel(ep: int, model: AnyModelConfig, world_size: int) -> None:
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


def validate_megatron_experts(cfg: MegatronConfig, model: AnyModelConfig) -> None:
    """``strategy=megatron`` with an MoE model: the tp ranks split the experts (each computes ``E / tp`` on every
    token and the outputs are summed over the group); pipeline stages hold their layers' experts whole. Refused
    where that is not built: transformers' MoE blocks, sequence parallelism, and experts that do not split evenly
    over tp."""
    experts = routed_experts(model)
    if not experts:
        return
    if isinstance(model, HFModelConfig):
        raise ConfigError(
            "strategy",
            f"strategy=megatron has no tensor-parallel plan for transformers' MoE blocks (model={model.name})",
            "use strategy=fsdp (with strategy.ep=... for expert parallelism) or strategy=ddp",
        )
    if cfg.tp > 1 and cfg.sequence_parallel:
        raise ConfigError(
            "strategy.sequence_parallel",
            "sequence parallelism around mixture-of-experts layers is not built yet",
            "use strategy.sequence_parallel=false",
        )
    if experts % cfg.tp:
        raise ConfigError(
            "strategy.tp",
            f"tp={cfg.tp} does not split the model's {experts} experts evenly (the tp ranks split them)",
            f"use a strategy.tp dividing {experts}: {_divisors(experts)}",
        )


def moe_layer_count(model: AnyModelConfig) -> int:
    """MoE layers of the built-in model or an HF MoE model (every block routes its MLP); 0 otherwise."""
    if not routed_experts(model):
        return 0
    return model.n_layers if isinstance(model, ModelConfig) else hf_shape(model).n_layers  # type: ignore[arg-type]


def validate_expert_placement(placement: list[list[int]] | None, ep: int, model: AnyModelConfig) -> None:
    """Refuse a ``strategy.expert_placement`` that is not one permutation of the experts, or one per MoE layer."""
    if placement is None:
        return
    key = "strategy.expert_placement"
    if ep <= 1:
        raise ConfigError(
            key, f"places experts on the ranks of an expert-parallel group, and strategy.ep={ep}",
            "set strategy.ep to a degree > 1, or strategy.expert_placement=null",
        )  # fmt: skip
    experts, layers = routed_experts(model), moe_layer_count(model)
    if len(placement) not in (1, layers):
        raise ConfigError(
            key, f"has {len(placement)} permutations; model {model.name} has {layers} MoE layers",
            f"give one permutation per MoE layer ({layers}) or a single one for every layer",
        )  # fmt: skip
    for layer, order in enumerate(placement):
        if sorted(order) != list(range(experts)):
            raise ConfigError(
                key, f"entry {layer} ({order}) is not a permutation of the {experts} expert ids 0..{experts - 1}",
                f"list every expert id 0..{experts - 1} exactly once; rank k of each ep group holds entries "
                f"[k*{experts // ep}, (k+1)*{experts // ep})",
            )  # fmt: skip
