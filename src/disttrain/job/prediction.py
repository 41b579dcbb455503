"""The planner's prediction for a run's own layout, recorded in run.json beside what the run measured.

Predictions use this machine's calibration when there is one (the run's own start-up measurements, or a
``calibration=RUN_DIR`` given on the command line), else the hw profile's datasheet numbers; run.json says which
per number. The comparison itself (``diagnostics.prediction``) is shared with the report and the sweep report.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diagnostics.calibration import Calibration, write_calibration
from diagnostics.prediction import compare
from disttrain.config.hf import reference_shape
from disttrain.config.schema import RunConfig, token_seq_len
from disttrain.planner import ModelShape, memory_per_gpu, model_shape
from disttrain.planner.calibrated import assumptions_for, calibrated_profile
from disttrain.planner.links import link_time
from disttrain.planner.measured import parts_basis
from disttrain.planner.plan import plan_layout
from disttrain.strategies.auto import workload
from disttrain.strategies.layout import ParallelLayout

if TYPE_CHECKING:
    from disttrain.training.build import TrainerParts


def predict_run(
    cfg: RunConfig, parallel: ParallelLayout, calibration: Calibration | None, shape: ModelShape | None = None
) -> dict[str, Any] | None:
    """Predicted memory, step time, communication, tokens/s and MFU of this run; None for a user model the planner
    cannot see into. ``shape``: a measured module's (planner/footprint.py), whose samples are its tokens. Step-time
    figures are absent, with the reason, when no peak is known."""
    if shape is None:
        reference = reference_shape(cfg.model)
        shape = model_shape(reference) if reference is not None else None
    layout = parallel.mesh
    if shape is None or layout is None:
        return None
    profile = calibrated_profile(cfg.hw, calibration, cfg.precision.compute_dtype)
    assumptions = assumptions_for(profile)
    work = workload(cfg, parallel.batch)
    record: dict[str, Any] = {
        "basis": profile.basis(shape, work),
        "calibration": calibration.source if calibration is not None else None,
        "layout": layout.label(),
    }
    predicted: dict[str, Any] = {}
    candidate = None
    if shape.measured_module and not shape.flops_per_sample and parts_basis(profile.parts, shape, work) is None:
        # Its compute would be 0 (no FLOPs counted, the module not timed): communication alone is no prediction.
        record["unpredicted"] = (
            "no FLOPs were counted for this module's step (no matmul or convolution ran) and it was not timed"
        )
    else:
        try:
            candidate = plan_layout(shape, layout, work, profile.hw, assumptions, profile.parts)
        except ValueError as err:  # no peak FLOP/s or no bandwidth for a link this layout uses
            # Without a peak the run could have measured its own (diagnostics on with calibrate) or been given one.
            fix = "" if calibration is not None else " and no calibration measured one (diagnostics.calibrate=true)"
            record["unpredicted"] = f"{err}{fix}"
    if candidate is None:
        memory = memory_per_gpu(shape, layout, work, assumptions.flash_attention)
    else:
        memory, estimate = candidate.memory, candidate.estimate
        predicted.update(
            step_time_s=estimate.step_time_s,
            compute_s=estimate.compute_s,
            # What the run measures as collective time includes waiting for the last rank.
            comm_s=link_time(candidate.comm, profile.hw, assumptions.host_link_gbps) + estimate.sync_wait_s,
            sync_wait_s=estimate.sync_wait_s,
            exposed_comm_s=estimate.exposed_comm_s,
            bubble_s=estimate.bubble_s,
            optimizer_step_s=estimate.optimizer_step_s,
            tp_dispatch_s=estimate.host_dispatch_s,
            fsdp_host_s=estimate.fsdp_host_s,
            zero_host_s=estimate.zero_host_s,
            loop_s=estimate.loop_s,
            tokens_per_s=estimate.tokens_per_s,
            mfu=estimate.mfu,
            peak_flops=profile.hw.peak_flops(cfg.precision.compute_dtype),
            # Which part of the traffic moves once per optimizer step and which is tensor parallelism's: what the
            # report's communication levers (accumulation, a smaller tp) can each save.
            comm_shares=candidate.comm_shares,
        )
    predicted.update(memory_bytes=memory.total, state_bytes=memory.params + memory.grads + memory.optimizer_states)
    record["predicted"] = predicted
    if profile.measured and cfg.hw.peak_flops(cfg.precision.compute_dtype) is not None:
        # How far the profile's datasheet alone would have been off: the same layout without the calibration.
        try:
            sheet = plan_layout(shape, layout, work, cfg.hw).estimate
        except ValueError:  # the profile lacks a link bandwidth this layout needs
            pass
        else:
            record["datasheet"] = {"step_time_s": sheet.step_time_s, "tokens_per_s": sheet.tokens_per_s}
    return record


def with_measurement(record: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """``record`` with what the run measured and each prediction's relative error (predicted / measured - 1)."""
    record = {**record, "measured": measured, "error": compare(record.get("predicted", {}), measured)}
    if "datasheet" in record:
        record["datasheet_error"] = compare(record["datasheet"], measured)
    return record


def predict_and_measure(
    run_cfg: RunConfig,
    parts: TrainerParts,
    run_dir: Path,
    planned: tuple[ParallelLayout, Calibration | None, ModelShape | None],
    peak_memory_bytes: int,
) -> dict | None:
    """The planner's prediction for this run (with this run's own start-up calibration, else ``calibration=``,
    else datasheet numbers) beside what rank 0 measured; writes RUN_DIR/calibration.json when it measured any."""
    parallel, given, shape = planned
    if shape is not None and shape.measured_module and not shape.flops_per_sample and parts.diagnostics is not None:
        # A module's FLOPs are counted at its first step (training/flop_count.py), after the launch measured it.
        shape = dataclasses.replace(shape, flops_per_sample=parts.diagnostics.flops_per_unit or None)
    own = write_calibration(run_dir) if run_cfg.diagnostics.enabled and run_cfg.diagnostics.calibrate else None
    record = predict_run(run_cfg, parallel, own or given, shape)
    if record is None:
        return None
    measured: dict = {}
    tokens_per_step = parallel.batch.global_batch_size * (token_seq_len(run_cfg.model) or 1)
    # The median step, as the telemetry's figure is (the report replaces this one): a whole-run mean carries
    # every burst of other work on a shared machine.
    step_time_s = parts.throughput.step_time_p50_s
    if step_time_s is None and parts.throughput.tokens_per_s:
        step_time_s = tokens_per_step / parts.throughput.tokens_per_s
    if step_time_s:
        tokens_per_s = tokens_per_step / step_time_s
        measured.update(tokens_per_s=tokens_per_s, step_time_s=step_time_s)
        predicted = record["predicted"]
        if predicted.get("mfu") and predicted.get("tokens_per_s"):
            measured["mfu"] = predicted["mfu"] * tokens_per_s / predicted["tokens_per_s"]
    if parts.diagnostics is not None and parts.diagnostics.training_state:
        measured["state_bytes"] = parts.diagnostics.training_state  # rank 0's; the report takes every rank's
    if run_cfg.hw.accelerator == "gpu":
        measured["memory_bytes"] = peak_memory_bytes
    return with_measurement(record, measured)
