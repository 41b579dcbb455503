"""The end of a run on rank 0: run.json completed, the planner's prediction beside the measurement, the summary
line, the HF export and the report."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from diagnostics.calibration import Calibration
from diagnostics.manifest import RunManifest
from diagnostics.prediction import one_line
from disttrain.checkpoint.resume import newest_complete
from disttrain.config.schema import LightningModuleConfig, RunConfig
from disttrain.job.describe import RunResult, describe_result
from disttrain.job.export import export_final_hf
from disttrain.job.prediction import predict_and_measure
from disttrain.job.report import say_report
from disttrain.launch.env import say
from disttrain.launch.exit_codes import NONFINITE, RunStopped
from disttrain.planner import ModelShape
from disttrain.strategies.layout import ParallelLayout
from disttrain.training.step_loss import logged_step_loss

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from disttrain.training.build import TrainerParts


def conclude(
    run_cfg: RunConfig,
    parts: TrainerParts,
    datamodule: pl.LightningDataModule,
    run_dir: Path,
    manifest: RunManifest,
    started: float,
    planned: tuple[ParallelLayout, Calibration | None, ModelShape | None],
) -> None:
    """Rank 0, every rank done: complete run.json, print the summary and write the report; a non-finite stop
    ends in RunStopped naming the last good checkpoint."""
    guard = parts.nonfinite
    stopped = guard is not None and guard.stopped
    # The run's peak before the module probe's copy of it (diagnostics.collect.module_timing), where one ran.
    probed_after = parts.diagnostics.module_timing.peak_before if parts.diagnostics is not None else None
    peak_memory = probed_after if probed_after is not None else measured_peak_memory()
    try:
        prediction = predict_and_measure(run_cfg, parts, run_dir, planned, peak_memory)
    except Exception as err:  # a layout the planner cannot model must not turn a finished run into a failure
        say(f"disttrain: no planner prediction for this run: {type(err).__name__}: {err}", file=sys.stderr)
        prediction = None
    result = run_result(run_cfg, parts, datamodule, (run_dir, started, peak_memory), prediction)
    pruned = parts.pruning.pruned_at if parts.pruning is not None else None
    manifest.status = "stopped" if stopped else "pruned" if pruned is not None else "completed"
    if pruned is not None:  # the sweep's pruner stopped it at this validation: a clean end, reported as usual
        manifest.pruned_at_step = pruned
        metric = parts.pruning.metric if parts.pruning is not None else "val/loss"
        say(f"disttrain: pruned at step {pruned}: the study's pruner judged this trial's {metric} hopeless")
    manifest.wall_time_s, manifest.result = result.wall_time_s, result
    manifest.result_gap_to_floor = result.gap_to_floor
    # No checkpoint is written for the bad step, so the newest complete one is the last good one.
    last = newest_complete(parts.ckpt_dir) if stopped else None
    if guard is not None:
        manifest.nonfinite = {
            "policy": guard.policy,
            "skipped_steps": guard.skipped_steps,
            "scaler_skipped_steps": guard.scaler_skipped_steps,
            "stopped_at_step": guard.stopped_at,
            "stop_reason": guard.stop_reason,
        }
        if stopped:  # the report names it (diagnostics/kinds/nonfinite.py)
            manifest.nonfinite["last_good_checkpoint"] = str(last.checkpoint) if last else None
    exported = export_final_hf(run_cfg, parts.ckpt_dir, run_dir) if not stopped else None
    manifest.hf_export = str(exported) if exported is not None else None
    manifest.prediction = prediction
    manifest.write(run_dir)
    say(describe_result(result))
    if exported is not None:
        say(f"  hf model    {exported} (transformers from_pretrained)")
    if guard is not None and guard.skipped_steps:
        say(f"  skipped     {len(guard.skipped_steps)} step(s) with non-finite loss/gradients: {guard.skipped_steps}")
    if run_cfg.diagnostics.enabled and run_cfg.diagnostics.report:
        report = say_report(run_dir, parts.trainer)
        if report is not None and report.prediction is not None:  # the telemetry measured more (comm, every rank)
            manifest.prediction = report.prediction
            manifest.write(run_dir)
    elif prediction is not None:
        say(f"  {one_line(prediction)}")
    if stopped and guard is not None:
        kept = f"; last good checkpoint: {last.checkpoint}" if last else "; no checkpoint was saved before it"
        raise RunStopped(NONFINITE, f"disttrain: stopped: {guard.stop_reason}{kept}")


def run_result(
    run_cfg: RunConfig,
    parts: TrainerParts,
    datamodule: pl.LightningDataModule,
    run: tuple[Path, float, int],
    prediction: dict | None,
) -> RunResult:
    """The summary line's figures: steps, losses against the data's floor, throughput, memory. ``run``: its dir,
    start time and this rank's peak memory."""
    run_dir, started, peak_memory = run
    metrics = parts.trainer.callback_metrics
    floor = getattr(datamodule, "loss_floor", None)
    throughput = parts.throughput
    own = own_metrics(metrics) if isinstance(run_cfg.model, LightningModuleConfig) else None
    return RunResult(
        steps=parts.trainer.global_step,
        wall_time_s=time.time() - started,
        train_loss=float(metrics["train/loss"]) if "train/loss" in metrics else logged_step_loss(parts.trainer),
        val_loss=float(metrics["val/loss"]) if "val/loss" in metrics else None,
        loss_floor=floor.window_floor if floor else None,
        entropy_rate=floor.entropy_rate if floor else None,
        tokens_per_s=throughput.tokens_per_s,
        run_dir=str(run_dir),
        samples_per_s=throughput.units_per_s if throughput.unit == "sample" else None,
        metrics=own,
        step_time_p50_s=parts.throughput.step_time_p50_s,
        predicted_memory_bytes=prediction["predicted"]["memory_bytes"] if prediction else None,
        measured_memory_bytes=peak_memory,
        memory_kind="peak RSS" if run_cfg.hw.accelerator == "cpu" else "peak allocated",
    )


def own_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """A LightningModule's logged scalars at the end (what ``self.log`` reached ``callback_metrics``), by name."""

    def scalar(value: Any) -> bool:
        if isinstance(value, torch.Tensor):
            return value.numel() == 1
        return isinstance(value, int | float) and not isinstance(value, bool)

    return {name: float(value) for name, value in sorted(metrics.items()) if scalar(value)}


def measured_peak_memory() -> int:
    """Peak bytes this rank used: GPU allocator peak on CUDA, else the process's peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
