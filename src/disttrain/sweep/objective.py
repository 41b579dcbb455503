"""What a job returns to a Hydra sweeper (``hydra/sweeper=optuna``): one number read from the run's run.json.

``objective=val_loss`` (the default) returns the final validation loss, to be minimized; ``objective=tokens_per_s``
the training throughput, to be maximized. The value is read from RUN_DIR/run.json, which rank 0 writes when the run
ends, so the same function serves a plain local run, a run whose attempts a restart supervisor ran (it never held
the result itself) and a SLURM task. Imports neither torch nor Lightning (the sweeper's config resolves through it).
"""

from __future__ import annotations

from pathlib import Path

from diagnostics.manifest import read_manifest

# objective -> (run.json result key, Optuna direction)
OBJECTIVES: dict[str, tuple[str, str]] = {
    "val_loss": ("val_loss", "minimize"),
    "tokens_per_s": ("tokens_per_s", "maximize"),
}


def objective_direction(objective: str) -> str:
    """``minimize`` or ``maximize``: the sweeper's direction for ``objective`` (``hydra.sweeper.direction``)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: unknown '{objective}'; use one of {sorted(OBJECTIVES)}")
    return OBJECTIVES[objective][1]


def objective_value(run_dir: Path, objective: str) -> float | None:
    """The finished run's ``objective`` from RUN_DIR/run.json; None where this process wrote none (a rank other
    than 0, a dry run) or the run measured none (no validation batches, too few steps to time)."""
    manifest, _ = read_manifest(run_dir)
    result = manifest.result if manifest is not None else None
    value = result.get(OBJECTIVES[objective][0]) if isinstance(result, dict) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
