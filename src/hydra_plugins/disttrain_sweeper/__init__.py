"""``hydra/sweeper=optuna``: hydra-optuna-sweeper, its direction following ``objective=``.

Each job returns its objective (``disttrain.job.objective``: final val loss or tokens/s). Here the plugin's own
``optuna`` entry is replaced by one whose ``direction`` follows the same key, so ``objective=tokens_per_s`` is
maximized without a second setting (``hydra.sweeper.direction=...`` still overrides it). It is a ConfigStore entry
rather than conf/hydra/sweeper/optuna.yaml because Hydra refuses a yaml file named like a ConfigStore schema.
The plugin's module is imported first, so its own registration cannot come after this one whatever order Hydra
scans ``hydra_plugins`` in. Registered on import: Hydra imports every ``hydra_plugins`` module before it composes.
"""

# No `from __future__ import annotations`: Hydra executes plugin modules outside sys.modules, where dataclasses
# cannot resolve string annotations.
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from disttrain.job.objective import objective_direction

OmegaConf.register_new_resolver("disttrain.objective_direction", objective_direction, replace=True)

try:
    from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf
except ImportError:  # hydra-optuna-sweeper is a dependency; without it only hydra/sweeper=optuna is unavailable
    OptunaSweeperConf = None

if OptunaSweeperConf is not None:

    @dataclass
    class DisttrainOptunaSweeperConf(OptunaSweeperConf):
        direction: Any = "${disttrain.objective_direction:${objective}}"

    ConfigStore.instance().store(
        group="hydra/sweeper", name="optuna", node=DisttrainOptunaSweeperConf, provider="disttrain"
    )
