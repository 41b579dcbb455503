"""The Optuna study of a ``hydra/sweeper=optuna`` sweep, read for the sweep report: trial states, the best trial,
and the trials the memory check screened out (they have no run dir: only the study knows them).

The study is found from the sweep dir alone: ``SWEEP_DIR/optuna.db`` (the default storage, also in a sweep dir
copied off a cluster), else the URL in ``SWEEP_DIR/optuna_study.json`` (a server's, password redacted: pass
``--storage`` to ``python -m diagnose sweep`` then). Imports Optuna lazily; without it the report has no study part.
The trial attribute names are the sweeper's (``disttrain.sweep.study``), repeated here: this layer imports no
``disttrain``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STORAGE_FILE = "optuna.db"
STUDY_RECORD = "optuna_study.json"
SCREENED_ATTR = "disttrain.screened"
JOB_ATTR = "disttrain.job"
INTERRUPTED_ATTR = "disttrain.interrupted"


@dataclass
class ScreenedTrial:
    number: int
    params: dict[str, Any]
    reason: str


@dataclass
class StudySummary:
    name: str
    storage: str
    direction: str
    states: dict[str, int]  # trial state -> count (screened and interrupted trials counted apart from failed)
    best: dict[str, Any] | None = None  # number, value, params, job
    screened: list[ScreenedTrial] = field(default_factory=list)
    jobs: dict[str, int] = field(default_factory=dict)  # job dir name -> trial number


def study_location(sweep_dir: Path, storage: str | None = None) -> tuple[str, str] | None:
    """(storage URL, study name) of the sweep's study, or None for a sweep without one."""
    record: dict[str, Any] = {}
    try:
        record = json.loads((sweep_dir / STUDY_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        if storage is None and not (sweep_dir / STORAGE_FILE).is_file():
            return None
    name = str(record.get("study_name") or "disttrain")
    if storage is None and (sweep_dir / STORAGE_FILE).is_file():
        storage = f"sqlite:///{(sweep_dir / STORAGE_FILE).absolute()}"
    storage = storage or record.get("storage")
    if not storage or ":***@" in storage:
        return None
    return storage, name


def read_study(sweep_dir: Path, storage: str | None = None) -> StudySummary | None:
    """The study's summary, or None where there is no study or Optuna is not installed."""
    location = study_location(Path(sweep_dir), storage)
    if location is None:
        return None
    try:
        import optuna
    except ImportError:
        return None
    url, name = location
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=name, storage=url)
    states: dict[str, int] = {}
    summary = StudySummary(name, url, study.direction.name.lower(), states)
    for trial in study.get_trials(deepcopy=False):
        state = trial.state.name.lower()
        if SCREENED_ATTR in trial.user_attrs:
            state = "screened"
            summary.screened.append(ScreenedTrial(trial.number, trial.params, str(trial.user_attrs[SCREENED_ATTR])))
        elif INTERRUPTED_ATTR in trial.user_attrs:
            state = "interrupted"
        states[state] = states.get(state, 0) + 1
        if JOB_ATTR in trial.user_attrs:
            summary.jobs[str(trial.user_attrs[JOB_ATTR])] = trial.number
    if states.get("complete"):
        best = study.best_trial
        summary.best = {
            "number": best.number,
            "value": best.value,
            "params": best.params,
            "job": best.user_attrs.get(JOB_ATTR),
        }
    return summary
