"""``hydra/sweeper=optuna``: disttrain's Optuna sweeper (``optuna_sweeper.py``), its config and option groups.

``hydra/sweeper/sampler=tpe|random|grid|cmaes`` and ``hydra/sweeper/pruner=none|median|successive_halving|
hyperband`` choose the sampler and pruner; their other keys are the Optuna classes' arguments
(``hydra.sweeper.sampler.seed=1``, ``hydra.sweeper.pruner.n_startup_trials=2``). ``direction`` follows
``objective=`` (``objective=tokens_per_s`` is maximized without a second setting). ConfigStore entries rather than
conf/hydra/sweeper/*.yaml: the sweeper's schema types them. Registered on import: Hydra imports every
``hydra_plugins`` module before it composes.
"""

# No `from __future__ import annotations`: Hydra executes plugin modules outside sys.modules, where dataclasses
# cannot resolve string annotations.
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional  # noqa: UP035 (OmegaConf's structured configs want typing's)

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from disttrain.sweep.objective import objective_direction

OmegaConf.register_new_resolver("disttrain.objective_direction", objective_direction, replace=True)


@dataclass
class SamplerConf:
    name: str = "tpe"
    seed: Optional[int] = None  # noqa: UP045


@dataclass
class MedianPrunerConf:
    name: str = "median"
    n_startup_trials: int = 5  # trials that complete before any is pruned
    n_warmup_steps: int = 0  # steps of a trial before it may be pruned
    interval_steps: int = 1


@dataclass
class SuccessiveHalvingPrunerConf:
    name: str = "successive_halving"
    min_resource: Any = "auto"
    reduction_factor: int = 4
    min_early_stopping_rate: int = 0


@dataclass
class HyperbandPrunerConf:
    name: str = "hyperband"
    min_resource: int = 1
    max_resource: Any = "auto"
    reduction_factor: int = 3


@dataclass
class NoPrunerConf:
    name: str = "none"


@dataclass
class DisttrainOptunaSweeperConf:
    _target_: str = "hydra_plugins.disttrain_sweeper.optuna_sweeper.OptunaSweeper"
    defaults: List[Any] = field(default_factory=lambda: [{"sampler": "tpe"}, {"pruner": "none"}])  # noqa: UP006
    sampler: Any = MISSING
    pruner: Any = MISSING
    direction: Any = "${disttrain.objective_direction:${objective}}"
    # An Optuna storage URL; null: SQLite in the sweep dir (SWEEP_DIR/optuna.db), so a rerun continues the study.
    storage: Optional[str] = None  # noqa: UP045
    study_name: str = "disttrain"
    n_trials: int = 20  # trials of the study in all (a rerun counts those it already has)
    n_jobs: int = 2  # trials launched together (one SLURM job array under hydra/launcher=slurm)
    # Search space in Hydra's sweep syntax, beside the command line's; non-sweep values are fixed, typed as given.
    params: Optional[Dict[str, Any]] = None  # noqa: UP006, UP045


store = ConfigStore.instance()
store.store(group="hydra/sweeper", name="optuna", node=DisttrainOptunaSweeperConf, provider="disttrain")
for _name in ("tpe", "random", "grid", "cmaes"):
    store.store(group="hydra/sweeper/sampler", name=_name, node=SamplerConf(name=_name), provider="disttrain")
for _name, _node in (
    ("none", NoPrunerConf),
    ("median", MedianPrunerConf),
    ("successive_halving", SuccessiveHalvingPrunerConf),
    ("hyperband", HyperbandPrunerConf),
):
    store.store(group="hydra/sweeper/pruner", name=_name, node=_node, provider="disttrain")
