"""strategy=auto's spec: nothing to build; the planner replaces it before launch (strategies/auto.py)."""

from __future__ import annotations

from disttrain.config.schema import RunConfig
from disttrain.planner import Layout
from disttrain.strategies.spec import StrategyBuild, StrategySpec


class AutoSpec(StrategySpec):
    """``strategy=auto`` before the planner resolves it (strategies/auto.py): data parallel over every process."""

    name = "auto"

    def planner_layout(self, dp: int, accumulation: int) -> Layout:
        raise ValueError("strategy=auto has no layout until resolve_auto picks one")

    def build(self, cfg: RunConfig, world_size: int, apply_checkpointing: object) -> StrategyBuild:
        raise ValueError("strategy=auto is resolved before launch (job/prepare.py); it is never built")
