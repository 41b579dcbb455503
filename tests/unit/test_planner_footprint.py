"""The planner over a measured module (planner/footprint.py): each data-parallel strategy's states from the module's
own optimizer, activations from its measured saved bytes, FLOPs per sample as counted, the sample as the unit."""

from __future__ import annotations

import math

import pytest

from disttrain.config.hardware import HardwareProfile
from disttrain.planner import plan
from disttrain.planner.footprint import ModuleFootprint, footprint_notes, footprint_shape

N = 1_000_003  # not a multiple of the world: partitions round up


def footprint(states: int | None, activations: int | None = 64 * 1000, flops: float | None = 5e6) -> ModuleFootprint:
    return ModuleFootprint(
        num_parameters=N,
        parameter_bytes=4 * N,
        gradient_bytes=4 * N,
        buffer_bytes=0,
        optimizer_state_bytes=states,
        activation_bytes=activations,
        micro_batch_size=64 if activations is not None else None,
        flops_per_sample=flops,
    )


HW = HardwareProfile(
    name="4xgpu", accelerator="gpu", devices_per_node=4, num_nodes=1, memory_per_device_gib=80.0,
    peak_tflops={"bf16": 300.0, "fp32": 60.0}, hbm_bandwidth_gbps=2000.0, intra_node_bandwidth_gbps=200.0,
)  # fmt: skip


def by_label(shape: object, precision: str = "fp32") -> dict[str, object]:
    result = plan(shape, HW, precision=precision, micro_batch_size=16)  # type: ignore[arg-type]
    return {c.label: c for c in result.candidates}


def test_sgd_with_momentum_holds_one_state_per_parameter_under_every_data_parallel_strategy() -> None:
    shape = footprint_shape("pkg.LitModel", footprint(states=4 * N))  # SGD with momentum: one fp32 buffer
    assert shape.optimizer_states == 1.0 and shape.unit == "sample" and shape.seq_len == 1
    layouts = by_label(shape)
    ddp, fsdp, zero2 = layouts["DDP"], layouts["FSDP2 full shard"], layouts["ZeRO-2"]
    assert (ddp.memory.params, ddp.memory.grads, ddp.memory.optimizer_states) == (4 * N, 4 * N, 4 * N)
    assert fsdp.memory.optimizer_states == 4 * math.ceil(N / 4)
    assert zero2.memory.optimizer_states == 4 * math.ceil(N / 4)  # fp32: no master copy, the momentum only
    mixed = by_label(shape, "bf16-mixed")["ZeRO-2"]
    assert mixed.memory.optimizer_states == (4 + 4) * math.ceil(N / 4)  # the fp32 master, then the momentum


def test_unmeasured_states_are_adams_and_said_so() -> None:
    measured = footprint(states=None)
    shape = footprint_shape("pkg.LitModel", measured)
    assert shape.optimizer_states == 2.0
    assert by_label(shape)["DDP"].memory.optimizer_states == 8 * N
    assert "optimizer states not measured: AdamW's two moments assumed" in footprint_notes(measured)


def test_activations_scale_with_the_planned_micro_batch_and_flops_are_the_counted_ones() -> None:
    shape = footprint_shape("pkg.LitModel", footprint(states=8 * N))
    ddp = by_label(shape)["DDP"]
    assert ddp.memory.activations == 16 * 1000  # 1000 bytes a sample, measured at 64 rows, planned at 16
    result = plan(shape, HW, precision="fp32", micro_batch_size=16)
    best = result.recommended
    assert best is not None and result.to_json()["unit"] == "sample"
    # Compute is the counted FLOPs over the peak x the efficiency, for every micro-batch of the step.
    for c in result.candidates:
        rate = 60e12 * result.assumptions.compute_efficiency
        assert c.estimate.compute_s == pytest.approx(c.layout.microbatches * 16 * 5e6 / rate)
        # MFU's numerator is the same count: the samples a second times the FLOPs of one.
        assert c.mfu == pytest.approx(c.tokens_per_s * 5e6 / (HW.world_size * 60e12))


def test_a_module_without_counted_flops_or_activations_plans_its_states_and_says_what_is_missing() -> None:
    measured = footprint(states=8 * N, activations=None, flops=None)
    shape = footprint_shape("pkg.LitModel", measured)
    assert by_label(shape)["DDP"].memory.activations == 0
    notes = footprint_notes(measured)
    assert "no matmul or convolution FLOPs counted: compute time is not predicted (0)" in notes
