"""The start-up parts probe on a tiny model: what it records, in the run's precision, and that the planner reads it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from diagnostics.calibration import calibration_from_telemetry
from diagnostics.collect.parts import time_model_parts
from diagnostics.telemetry import RECORD_FIELDS, TelemetryWriter
from disttrain.config.schema import OptimizerConfig
from disttrain.models.probe_parts import model_parts
from disttrain.planner.measured import MeasuredParts
from disttrain.planner.shapes import model_shape
from tests.conftest import model_preset

TINY = dataclasses.replace(model_preset("gpt-nano"), n_layers=2, d_model=32, n_heads=2, ffn_hidden=64, seq_len=32)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16-true"])
def test_the_probe_times_every_part_in_the_runs_precision_and_the_planner_reads_it(
    precision: str, tmp_path: Path
) -> None:
    parts = model_parts(TINY, OptimizerConfig(), precision, torch.device("cpu"))
    assert parts["block_numel"] == model_shape(TINY).block_parameters
    expected = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert all(p.dtype == expected for p in parts["block"].parameters())
    result = time_model_parts(torch.device("cpu"), parts, micro_batch=2)
    assert (result["micro_batch"], result["seq_len"], result["d_model"]) == (2, 32, 32)
    assert all(result[k] > 0 for k in ("block_forward_s", "block_backward_s", "edges_forward_s", "optimizer_step_s"))
    writer = TelemetryWriter(tmp_path, 0)
    writer.write("parts_calibration", precision=precision, **result)
    writer.close()
    assert set(RECORD_FIELDS["parts_calibration"]) <= {"precision", *result}
    measured = MeasuredParts.from_figures(calibration_from_telemetry(tmp_path).parts)
    assert measured is not None and measured.precision == precision and measured.block_numel == parts["block_numel"]
