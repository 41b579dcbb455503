"""What a job returns to a Hydra sweeper (``hydra/sweeper=optuna``): one number read from the run's run.json.

``objective=val_loss`` (the default) returns the final validation loss, to be minimized; ``objective=tokens_per_s``
(``samples_per_s``) the training throughput, to be maximized. Any other name is a metric the run's module logs with
``self.log`` (a user's LightningModule: ``objective=val_acc``), read from its final logged metrics; its direction
is ``maximize`` for names that measure a gain (accuracy, AUC, F1, precision, recall, mAP, IoU, R², a rate per
second) and ``minimize`` otherwise, unless the name says it: ``objective=max:val_score`` or ``min:val_mae``.

The value is read from RUN_DIR/run.json, which rank 0 writes when the run ends, so the same function serves a plain
local run, a run whose attempts a restart supervisor ran (it never held the result itself) and a SLURM task.
Imports neither torch nor Lightning (the sweeper's config resolves through it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diagnostics.manifest import read_manifest
from disttrain.config.objective import OBJECTIVES, objective_direction, split_objective

__all__ = ["OBJECTIVES", "objective_direction", "objective_value"]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def objective_value(run_dir: Path, objective: str) -> float | None:
    """The finished run's ``objective`` from RUN_DIR/run.json; None where this process wrote none (a rank other
    than 0, a dry run) or the run measured none (no validation batches, too few steps to time, a metric the module
    did not log)."""
    manifest, _ = read_manifest(run_dir)
    result = manifest.result if manifest is not None else None
    if not isinstance(result, dict):
        return None
    name, _ = split_objective(objective)
    if name in OBJECTIVES and (value := _number(result.get(OBJECTIVES[name][0]))) is not None:
        return value
    logged = result.get("metrics")
    return _number(logged.get(name)) if isinstance(logged, dict) else None
