"""The Optuna study of a sweep: its storage, sampler and pruner, and the trial a job reports to.

The study lives in an Optuna storage, by default a SQLite file in the sweep dir (``SWEEP_DIR/optuna.db``), else
the URL given (``hydra.sweeper.storage=postgresql://...``, which several sweeps or machines can share). So a sweep
rerun with the same command (and ``hydra.sweep.dir``) continues its study, and the jobs, on this machine or on
SLURM nodes, open the same study to report their validation losses. The pruner's settings are stored in the study
itself (a study user attribute): a job builds the same pruner from them without being told.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrain.config.errors import ConfigError
from disttrain.config.schema import TrialConfig

# An Optuna sweep's record of its study: a sweep dir holding one is continued by a new launch, not refused.
STUDY_RECORD = "optuna_study.json"

if TYPE_CHECKING:
    import optuna

STORAGE_FILE = "optuna.db"
PRUNER_ATTR = "disttrain.pruner"
# Trial user attributes the sweeper sets (also read by diagnostics/report/sweep_study.py, by these names).
SCREENED_ATTR = "disttrain.screened"  # why the memory check refused the trial's config (never launched)
JOB_ATTR = "disttrain.job"  # the job's dir, relative to the sweep dir
SWEEP_DIR_ATTR = "disttrain.sweep_dir"
INTERRUPTED_ATTR = "disttrain.interrupted"  # the sweep died while the trial ran; it was asked again
ERROR_ATTR = "disttrain.error"

SAMPLERS = ("tpe", "random", "grid", "cmaes")
PRUNERS = ("none", "median", "successive_halving", "hyperband")
# SQLite serializes writers; jobs reporting at the same moment wait for each other rather than fail.
SQLITE_TIMEOUT_S = 60


@dataclass(frozen=True)
class SweepSettings:
    """``hydra.sweeper`` of ``hydra/sweeper=optuna``, checked."""

    direction: str
    n_trials: int
    n_jobs: int
    study_name: str
    storage: str | None  # None: SQLite in the sweep dir
    sampler: dict[str, Any] = field(default_factory=lambda: {"name": "tpe"})
    pruner: dict[str, Any] = field(default_factory=lambda: {"name": "none"})

    @property
    def prunes(self) -> bool:
        return self.pruner.get("name", "none") != "none"


def sweep_settings(node: dict[str, Any], objective: str) -> SweepSettings:
    """The sweeper's config as settings; ConfigError naming the key for anything it cannot run."""
    sampler = dict(node.get("sampler") or {"name": "tpe"})
    pruner = dict(node.get("pruner") or {"name": "none"})
    for key, spec, names in (("sampler", sampler, SAMPLERS), ("pruner", pruner, PRUNERS)):
        if spec.get("name") not in names:
            raise ConfigError(
                f"hydra/sweeper/{key}", f"unknown {key} {spec.get('name')!r}", f"use one of {list(names)}"
            )
    for key in ("n_trials", "n_jobs"):
        if not isinstance(node.get(key), int) or node[key] < 1:
            raise ConfigError(f"hydra.sweeper.{key}", f"expected a positive integer, got {node.get(key)!r}", "e.g. 8")
    if node.get("direction") not in ("minimize", "maximize"):
        raise ConfigError("hydra.sweeper.direction", f"got {node.get('direction')!r}", "use minimize or maximize")
    if pruner["name"] != "none" and objective != "val_loss":
        raise ConfigError(
            "hydra/sweeper/pruner",
            f"a pruner compares the validation losses trials report, but objective={objective} is not one",
            "use objective=val_loss, or hydra/sweeper/pruner=none",
        )
    if sampler["name"] == "cmaes":
        try:
            import cmaes  # noqa: F401  (optuna's CmaEsSampler needs it and says so only at the first trial)
        except ImportError:
            raise ConfigError(
                "hydra/sweeper/sampler", "cmaes needs the cmaes package", "pip install cmaes, or use sampler=tpe"
            ) from None
    storage = node.get("storage")
    if storage is not None and (not isinstance(storage, str) or "://" not in storage):
        raise ConfigError(
            "hydra.sweeper.storage",
            f"expected a storage URL, got {storage!r}",
            "use e.g. sqlite:////shared/study.db or postgresql://user@host/db (null: SQLite in the sweep dir)",
        )
    name = node.get("study_name") or "disttrain"
    return SweepSettings(node["direction"], node["n_trials"], node["n_jobs"], str(name), storage, sampler, pruner)


def storage_url(settings: SweepSettings, sweep_dir: Path) -> str:
    """The study's storage: the given URL, else ``sqlite:////<abs sweep dir>/optuna.db``."""
    return settings.storage or f"sqlite:///{(Path(sweep_dir).absolute() / STORAGE_FILE)}"


def open_storage(url: str) -> optuna.storages.BaseStorage:
    import optuna

    kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if url.startswith("sqlite") else {}
    return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)


def build_pruner(spec: dict[str, Any]) -> optuna.pruners.BasePruner:
    import optuna

    kwargs = {k: v for k, v in spec.items() if k != "name"}
    name = spec.get("name", "none")
    if name == "median":
        return optuna.pruners.MedianPruner(**kwargs)
    if name == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(**kwargs)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(**kwargs)
    return optuna.pruners.NopPruner()


def build_sampler(spec: dict[str, Any], grid: dict[str, list[Any]] | None) -> optuna.samplers.BaseSampler:
    import optuna

    kwargs = {k: v for k, v in spec.items() if k != "name"}
    name = spec["name"]
    if name == "grid":
        assert grid is not None
        return _grid_sampler_class()(grid, **kwargs)
    if name == "random":
        return optuna.samplers.RandomSampler(**kwargs)
    if name == "cmaes":
        return optuna.samplers.CmaEsSampler(**kwargs)
    return optuna.samplers.TPESampler(**kwargs)


def _grid_sampler_class() -> type:
    import optuna

    class _AskTellGridSampler(optuna.samplers.GridSampler):
        """GridSampler that does not stop the study when the grid is done: ``Study.stop`` only works inside
        ``optimize`` and raises under ask/tell; the sweeper caps the trials at the grid's size itself."""

        def after_trial(self, *args: Any, **kwargs: Any) -> None:
            return None

    return _AskTellGridSampler


def open_study(settings: SweepSettings, url: str, grid: dict[str, list[Any]] | None) -> optuna.Study:
    """The study (created, or loaded to continue it); its direction must be the one this sweep optimizes."""
    import optuna

    study = optuna.create_study(
        storage=open_storage(url),
        study_name=settings.study_name,
        direction=settings.direction,
        sampler=build_sampler(settings.sampler, grid),
        pruner=build_pruner(settings.pruner),
        load_if_exists=True,
    )
    if study.direction.name.lower() != settings.direction:
        raise ConfigError(
            "hydra.sweeper.study_name",
            f"the study '{settings.study_name}' in {redact_url(url)} was made to {study.direction.name.lower()}, "
            f"this sweep would {settings.direction}",
            "use another hydra.sweeper.study_name (or hydra.sweep.dir), or the study's objective",
        )
    study.set_user_attr(PRUNER_ATTR, settings.pruner)
    return study


def redact_url(url: str) -> str:
    """The URL without a password (``postgresql://user:***@host/db``): what is written to files and printed."""
    head, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in creds:
        return url
    return f"{head}://{creds.split(':', 1)[0]}:***@{host}"


def link_overrides(url: str, study: str, number: int) -> list[str]:
    from disttrain.sweep.space import format_override

    return [format_override("trial.storage", url), format_override("trial.study", study), f"trial.number={number}"]


def load_trial(link: TrialConfig) -> optuna.Trial:
    """The running trial ``link`` names, with the study's pruner (as the sweeper stored it)."""
    import optuna

    assert link.storage is not None and link.study is not None, "load_trial needs a linked trial (trial.*)"
    storage = open_storage(link.storage)
    spec = storage.get_study_user_attrs(storage.get_study_id_from_name(link.study)).get(PRUNER_ATTR) or {}
    study = optuna.load_study(study_name=link.study, storage=storage, pruner=build_pruner(spec))
    trial_id = storage.get_trial_id_from_study_id_trial_number(study._study_id, link.number)
    return optuna.trial.Trial(study, trial_id)
