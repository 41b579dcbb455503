"""``hydra/sweeper=optuna`` checked before Hydra starts: the sweeper's settings and the search space, so a typo in
``hydra.sweeper.*`` or an unsampleable override is one line (exit 2) before any dir, study or process exists."""

from __future__ import annotations

from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf

from disttrain.sweep.space import SearchSpace, build_search_space
from disttrain.sweep.study import SweepSettings, sweep_settings

OPTUNA_TARGET = "hydra_plugins.disttrain_sweeper.optuna_sweeper.OptunaSweeper"


def is_optuna_sweep(cfg: DictConfig) -> bool:
    return str(OmegaConf.select(cfg, "hydra.sweeper._target_", default="")) == OPTUNA_TARGET


def check_optuna_sweep(cfg: DictConfig, overrides: list[Override]) -> tuple[SweepSettings, SearchSpace]:
    """The sweep's settings and space as the sweeper will build them (ConfigError for what it cannot run)."""
    node = OmegaConf.to_container(cfg.hydra.sweeper, resolve=True)
    assert isinstance(node, dict)
    settings = sweep_settings(node, str(cfg.objective))  # type: ignore[arg-type]
    space = build_search_space([o for o in overrides if not o.is_hydra_override()], node.get("params"))  # type: ignore[arg-type]
    if settings.sampler["name"] == "grid":
        space.grid()
    return settings, space
