"""Overrides that make a run predicted not to fit its devices fit, with the memory each leaves: what the refusal
names, so a user reads ``strategy.activation_checkpointing=true (56.4 GiB)`` instead of "lower something".

Two levers keep the run's global batch (and so its optimization) unchanged: recomputing activations in backward,
and a smaller micro-batch with more accumulation. Each is tried alone, then both together; other layouts are what
``python -m plan`` and ``strategy=auto`` are for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from disttrain.config.errors import ConfigError
from disttrain.config.schema import RunConfig
from disttrain.config.strategy_schema import (
    AutoStrategyConfig,
    DeepSpeedConfig,
    FSDPConfig,
    MegatronConfig,
    StrategyConfig,
)
from disttrain.planner import MemoryBreakdown
from disttrain.planner.plan import GIB

Predictor = Callable[[RunConfig], MemoryBreakdown | None]


def recomputation(strategy: StrategyConfig | AutoStrategyConfig) -> list[tuple[StrategyConfig, str]]:
    """The strategy with more activation recomputation than it has, cheapest first, with its override."""
    switch = "strategy.activation_checkpointing"
    if isinstance(strategy, (FSDPConfig, DeepSpeedConfig)) and not strategy.activation_checkpointing:
        return [(dataclasses.replace(strategy, activation_checkpointing=True), f"{switch}=true")]
    if isinstance(strategy, MegatronConfig):
        order = ["none", "selective", "full"]
        if strategy.activation_checkpointing in order:
            stronger = order[order.index(strategy.activation_checkpointing) + 1 :]
            return [(dataclasses.replace(strategy, activation_checkpointing=m), f"{switch}={m}") for m in stronger]
    return []  # DDP has no recomputation switch here


def smaller_micro_batches(cfg: RunConfig, global_batch: int) -> list[tuple[RunConfig, str]]:
    """The run at each smaller micro-batch that divides its global batch, largest first, the global batch pinned."""
    options = []
    pin = "" if cfg.trainer.global_batch_size is not None else f" trainer.global_batch_size={global_batch}"
    for micro in range(cfg.trainer.micro_batch_size - 1, 0, -1):
        trainer = dataclasses.replace(cfg.trainer, micro_batch_size=micro, global_batch_size=global_batch)
        options.append((dataclasses.replace(cfg, trainer=trainer), f"trainer.micro_batch_size={micro}{pin}"))
    return options


def fitting_overrides(cfg: RunConfig, global_batch: int, limit: float, predict: Predictor) -> list[str]:
    """Up to two ways to fit ``limit`` bytes per device, each as overrides with its predicted memory: recomputation
    alone, the largest micro-batch that fits alone, and where neither does, both together."""

    def fits(variant: RunConfig) -> MemoryBreakdown | None:
        try:
            memory = predict(variant)
        except ConfigError:  # a micro-batch the layout's rules refuse (e.g. pipeline micro-batches)
            return None
        return memory if memory is not None and memory.total <= limit else None

    def first_fit(options: list[tuple[RunConfig, str]]) -> str | None:
        for variant, overrides in options:
            memory = fits(variant)
            if memory is not None:
                return f"{overrides} ({memory.total / GIB:.1f} GiB)"
        return None

    recomputed = [(dataclasses.replace(cfg, strategy=s), o) for s, o in recomputation(cfg.strategy)]
    found = [f for f in (first_fit(recomputed), first_fit(smaller_micro_batches(cfg, global_batch))) if f]
    if found or not recomputed:
        return found
    strongest, switch = recomputed[-1]
    both = first_fit([(variant, f"{switch} {o}") for variant, o in smaller_micro_batches(strongest, global_batch)])
    return [both] if both else []
