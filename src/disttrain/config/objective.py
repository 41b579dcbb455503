"""The names ``objective=`` takes and their sweep direction (disttrain.sweep.objective reads the values).

A built-in name (``val_loss``, minimized; ``tokens_per_s`` and ``samples_per_s``, maximized) or any metric the run's
module logs (``objective=val_acc``): maximized for names that measure a gain (accuracy, AUC, F1, precision, recall,
mAP, IoU, Dice, R², NDCG, hit rate, a rate per second), minimized otherwise, unless ``max:`` or ``min:`` says so.
"""

from __future__ import annotations

import re

# objective -> (run.json result key, Optuna direction)
OBJECTIVES: dict[str, tuple[str, str]] = {
    "val_loss": ("val_loss", "minimize"),
    "tokens_per_s": ("tokens_per_s", "maximize"),
    "samples_per_s": ("samples_per_s", "maximize"),
}
DIRECTION_PREFIXES = {"max": "maximize", "min": "minimize"}
# Words of a metric's name that mean higher is better (checked between separators: "val_acc", "top5_accuracy").
GAINS = ("acc", "accuracy", "auc", "auroc", "f1", "precision", "recall", "map", "iou", "dice", "r2", "ndcg", "hit")
METRIC_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]*$")


def split_objective(objective: str) -> tuple[str, str | None]:
    """(metric name, explicit direction or None) of ``objective``."""
    head, sep, name = objective.partition(":")
    if sep and head in DIRECTION_PREFIXES:
        return name, DIRECTION_PREFIXES[head]
    return objective, None


def objective_problem(objective: str) -> str | None:
    """Why ``objective`` cannot name a metric, or None."""
    name, _ = split_objective(objective)
    if name in OBJECTIVES or METRIC_NAME.match(name):
        return None
    return f"'{objective}' is not a metric name (letters, digits, _ . / -; optionally max: or min: before it)"


def objective_direction(objective: str) -> str:
    """``minimize`` or ``maximize``: the sweeper's direction for ``objective`` (``hydra.sweeper.direction``)."""
    if (problem := objective_problem(objective)) is not None:
        raise ValueError(f"objective: {problem}")
    name, explicit = split_objective(objective)
    if explicit is not None:
        return explicit
    if name in OBJECTIVES:
        return OBJECTIVES[name][1]
    words = re.split(r"[^a-z0-9]+", name.lower())
    gains = any(word in GAINS or word.rstrip("0123456789") in GAINS for word in words)
    return "maximize" if gains or name.endswith("_per_s") else "minimize"
