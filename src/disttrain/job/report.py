"""The bottleneck report at the end of a run (a finished one, or a failed one from the failure path)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from diagnostics.report import diagnose_run
from disttrain.launch.env import say

if TYPE_CHECKING:
    from diagnostics.report import Report


def say_report(run_dir: Path, trainer: object | None = None, quiet: bool = False) -> Report | None:
    """The bottleneck report, after every rank has finished writing telemetry, through the function that
    ``python -m diagnose`` uses; prints its summary unless ``quiet``, and attaches it to the ``trainer``'s loggers
    that can hold it (wandb, TensorBoard). Never fails the run."""
    # Imported here: the failure path of a run that never built a trainer must not pay for the report's imports.
    from disttrain.training.logger_text import attach_report

    try:
        report = diagnose_run(run_dir)
        if not quiet:
            say(report.text_summary())
        if trainer is not None:
            attached = attach_report(trainer.loggers, run_dir, trainer.global_step)  # type: ignore[attr-defined]
            if attached:
                say(f"  the report is attached to the {' and the '.join(attached)}")
        return report
    except Exception as err:  # a broken report must not turn a finished training run into a failure
        say(f"disttrain: could not write the diagnostics report: {type(err).__name__}: {err}", file=sys.stderr)
        return None
