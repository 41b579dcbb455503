"""What the sweeper tells the study about each trial, and how a rerun picks up the trials a dead sweep left.

A trial's outcome is read from its job's run dir (run.json), like the objective itself: ``completed`` with an
objective -> COMPLETE with it, ``pruned`` -> PRUNED (Optuna keeps its last reported loss), anything else -> FAIL.
A trial still RUNNING when the sweep starts belonged to a sweep that died (one sweep holds a sweep dir at a
time: claim.py); if its job finished anyway (a SLURM job outlives the sweep that submitted it) its outcome is
told, else it is failed as ``interrupted`` and its parameters are asked again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diagnostics.manifest import read_manifest
from disttrain.sweep.objective import objective_value
from disttrain.sweep.study import (
    ERROR_ATTR,
    INTERRUPTED_ATTR,
    JOB_ATTR,
    SCREENED_ATTR,
    STUDY_RECORD,
    SWEEP_DIR_ATTR,
    redact_url,
)

if TYPE_CHECKING:
    import optuna


def counted(study: optuna.Study) -> int:
    """Trials that count towards ``n_trials``: finished ones, except those an interrupted sweep left (re-asked)."""
    return sum(t.state.is_finished() and INTERRUPTED_ATTR not in t.user_attrs for t in study.get_trials(deepcopy=False))


def outcome(run_dir: Path, objective: str) -> tuple[str, float | None]:
    """(``complete`` | ``pruned`` | ``fail`` | ``unfinished``, objective value) of a trial's job from run.json."""
    manifest, _ = read_manifest(run_dir)
    status = manifest.status if manifest is not None else None
    value = objective_value(run_dir, objective)
    if status == "pruned":
        return "pruned", value
    if status == "completed":
        return ("complete", value) if value is not None else ("fail", None)
    if status in (None, "running"):
        return "unfinished", None
    return "fail", None


def tell_outcome(study: optuna.Study, number: int, state: str, value: float | None, error: str | None = None) -> None:
    from optuna.trial import TrialState

    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
    if error:
        study._storage.set_trial_user_attr(trial_id, ERROR_ATTR, error[:500])
    if state == "complete":
        study.tell(number, value)
    elif state == "pruned":
        study.tell(number, state=TrialState.PRUNED)
    else:
        study.tell(number, state=TrialState.FAIL)


def screen_out(study: optuna.Study, trial: optuna.Trial, reason: str) -> None:
    """Record a trial the memory check refused: never launched; the sampler is told it failed (TPE then samples
    around it no more than around any failed trial; the grid sampler counts the point as visited)."""
    from optuna.trial import TrialState

    trial.set_user_attr(SCREENED_ATTR, reason)
    study.tell(trial, state=TrialState.FAIL)


def recover_interrupted(study: optuna.Study, sweep_dir: Path, objective: str) -> list[str]:
    """Settle the RUNNING trials of this sweep dir a dead sweep left (see the module doc); one line each."""
    from optuna.trial import TrialState

    lines = []
    here = str(Path(sweep_dir).absolute())
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if trial.user_attrs.get(SWEEP_DIR_ATTR) != here:
            continue  # another sweep's trial in a shared storage: it may well be running
        job = trial.user_attrs.get(JOB_ATTR)
        state, value = outcome(Path(here) / job, objective) if job is not None else ("unfinished", None)
        if state == "unfinished":
            trial_id = trial._trial_id
            study._storage.set_trial_user_attr(trial_id, INTERRUPTED_ATTR, True)
            study.tell(trial.number, state=TrialState.FAIL)
            study.enqueue_trial(trial.params)
            lines.append(f"trial {trial.number}: interrupted with the sweep that ran it; asked again")
        else:
            tell_outcome(study, trial.number, state, value)
            lines.append(f"trial {trial.number}: its job ended {state} after the sweep that ran it")
    return lines


def next_job_number(sweep_dir: Path) -> int:
    """The first job number whose run dir does not exist (a rerun never writes into an earlier trial's dir)."""
    numbers = [int(p.name) for p in Path(sweep_dir).iterdir() if p.name.isdigit()] if Path(sweep_dir).is_dir() else []
    return max(numbers, default=-1) + 1


def record_study(sweep_dir: Path, url: str, study: optuna.Study, objective: str) -> None:
    """``SWEEP_DIR/optuna_study.json``: where the study is, for ``python -m diagnose sweep`` (password redacted)."""
    record = {"storage": redact_url(url), "study_name": study.study_name, "objective": objective}
    (Path(sweep_dir) / STUDY_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def best_summary(study: optuna.Study) -> dict[str, Any] | None:
    """The best trial (``optimization_results.yaml``), or None before any trial completed."""
    from optuna.trial import TrialState

    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return None
    best = study.best_trial
    return {
        "name": study.study_name,
        "best_trial": best.number,
        "best_params": best.params,
        "best_value": best.value,
        "best_job": best.user_attrs.get(JOB_ATTR),
    }
