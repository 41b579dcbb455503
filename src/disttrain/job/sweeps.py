"""Sweeps (``python -m train -m ...``): record why a job failed in its run dir, and write the sweep report.

``SweepCallback`` is a Hydra callback (``hydra.callbacks`` in ``conf/train.yaml``). In the process that ran a job
it writes ``RUN_DIR/failure.json`` when the job raised, so the sweep report can list the error from files alone
(also for a run dir copied off a cluster). Under Hydra's local launcher the jobs run one after the other in the
launching process, which rewrites the sweep report after every job: the last one leaves the complete report even
when an earlier job failed and Hydra then ends the multirun with that failure. Under ``hydra/launcher=slurm``
the launcher writes the report once all jobs have ended. Imports neither torch nor Lightning.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from diagnostics.report.sweep import build_sweep_report
from diagnostics.report.sweep_render import write_sweep_report
from disttrain.launch.env import process_role
from disttrain.training.wandb_sweep import attach_sweep_report, sweep_group

FAILURE_FILE = "failure.json"
TRACEBACK_CHARS = 6000


def record_failure(
    run_dir: Path, error: BaseException, source: str, overrides: list[str] | None = None, log: str | None = None
) -> bool:
    """Write ``RUN_DIR/failure.json`` unless one exists (the first failure is the cause; later ones follow it)."""
    trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    record: dict[str, Any] = {
        "error": f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}",
        "source": source,
        "rank": process_role().global_rank,
        "traceback": trace[-TRACEBACK_CHARS:],
    }
    if overrides is not None:
        record["overrides"] = overrides
    if log is not None:
        record["log"] = log
    return write_failure(run_dir, record)


def write_failure(run_dir: Path, record: dict[str, Any]) -> bool:
    """Write ``record`` as ``RUN_DIR/failure.json`` unless one exists; False when it did."""
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(run_dir / FAILURE_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=2, default=str)
        handle.write("\n")
    return True


class SweepCallback(Callback):
    """Failure records for every run; the sweep report after each job of a local multirun (see module doc)."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        run_dir = Path(str(config.hydra.runtime.output_dir))
        rank = process_role().global_rank
        if job_return.status == JobStatus.FAILED and isinstance(job_return._return_value, BaseException):
            where = "SLURM task" if "SLURM_PROCID" in os.environ else "job"
            record_failure(run_dir, job_return._return_value, f"{where} (rank {rank})")
        # In a submitit job (SUBMITIT_FOLDER) other jobs run concurrently: the launcher writes the report.
        if (
            config.hydra.mode == RunMode.MULTIRUN
            and "SUBMITIT_FOLDER" not in os.environ
            and process_role().global_rank == 0
        ):
            write_report_quietly(Path(str(config.hydra.sweep.dir)))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if str(config.hydra.launcher.get("_target_", "")).startswith("hydra_plugins.disttrain_launcher."):
            return  # written (and printed) by the launcher once its jobs ended
        write_report_quietly(Path(str(config.hydra.sweep.dir)), say=True)


def write_report_quietly(sweep_dir: Path, say: bool = False) -> None:
    """Write the sweep report; a failure to do so is printed, never raised (the runs themselves are done).
    ``say``: the sweep has ended: print the report's summary and attach it to the sweep's wandb group."""
    try:
        report = build_sweep_report(sweep_dir)
        out = write_sweep_report(report)
        if say:
            print(report.text_summary(), flush=True)
    except Exception as err:
        print(f"disttrain: could not write the sweep report of {sweep_dir}: {type(err).__name__}: {err}", flush=True)
        return
    if say:
        try:
            where = attach_sweep_report(sweep_dir, out, report.text_summary())
            if where:
                print(f"sweep report attached to wandb group {sweep_group(sweep_dir)}: {where}", flush=True)
        except Exception as err:
            print(f"disttrain: could not attach the sweep report to wandb: {type(err).__name__}: {err}", flush=True)
