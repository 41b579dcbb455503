"""A layout's step composed from the run's measured parts (one block, the edges, a block's optimizer step)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from diagnostics.calibration import Calibration, calibration_from_telemetry, parts_figures
from diagnostics.telemetry import TelemetryWriter
from disttrain.config.schema import ModelConfig
from disttrain.planner.calibrated import calibrated_profile
from disttrain.planner.comm import comm_plan
from disttrain.planner.measured import MeasuredParts, parts_basis, parts_compute, recompute_share
from disttrain.planner.memory import MemoryBreakdown
from disttrain.planner.plan import DEFAULT_ASSUMPTIONS, plan, plan_layout
from disttrain.planner.shapes import model_shape
from disttrain.planner.spec import Layout, Workload
from disttrain.planner.step_time import estimate_step, gpu_optimizer_parameters
from tests.conftest import hw_profile

NANO = ModelConfig(
    name="gpt-nano", n_layers=4, d_model=192, n_heads=6, ffn_hidden=768, vocab_size=256, seq_len=128, pos_emb="rope"
)
SHAPE = model_shape(NANO)
WORK = Workload(micro_batch_size=16, global_batch_size=32, seq_len=128, precision="fp32")
# Seconds chosen so every term is told apart: block forward 10 ms, backward 20 ms, edges 1 + 3 ms, optimizer 2 ms.
PARTS = MeasuredParts(
    block_forward_s=0.010,
    block_backward_s=0.020,
    edges_forward_s=0.001,
    edges_backward_s=0.003,
    optimizer_step_s=0.002,
    micro_batch=16,
    seq_len=128,
    d_model=192,
    vocab_size=256,
    block_numel=SHAPE.block_parameters,
    precision="fp32",
)
PER_PARAM = 0.002 / SHAPE.block_parameters


def compose(layout: Layout, work: Workload = WORK, parts: MeasuredParts = PARTS):
    return parts_compute(parts, SHAPE, layout, work, gpu_optimizer_parameters(SHAPE, layout))


def test_ddp_runs_every_block_and_the_edges_and_steps_every_parameter() -> None:
    got = compose(Layout("ddp", dp=2))
    assert got.basis == "measured"
    assert got.forward_s == pytest.approx(4 * 0.010 + 0.001)
    assert got.backward_s == pytest.approx(4 * 0.020 + 0.003)
    assert got.optimizer_step_s == pytest.approx(PER_PARAM * SHAPE.num_parameters)


def test_fsdp_and_zero_keep_the_compute_and_step_only_their_shard() -> None:
    ddp = compose(Layout("ddp", dp=2))
    fsdp = compose(Layout("fsdp", dp=2))
    zero = compose(Layout("deepspeed", dp=2, zero_stage=2))
    for sharded in (fsdp, zero):  # the parameters are gathered whole: the math per rank is DDP's
        assert (sharded.forward_s, sharded.backward_s) == pytest.approx((ddp.forward_s, ddp.backward_s))
    assert fsdp.optimizer_step_s == pytest.approx(PER_PARAM * SHAPE.fsdp_shard_parameters(2))
    assert zero.optimizer_step_s == pytest.approx(PER_PARAM * math.ceil(SHAPE.num_parameters / 2))
    assert fsdp.optimizer_step_s < ddp.optimizer_step_s / 1.9


def test_tensor_parallelism_splits_every_parts_math() -> None:
    got = compose(Layout("megatron", tp=2))
    assert got.forward_s == pytest.approx((4 * 0.010 + 0.001) / 2)
    assert got.backward_s == pytest.approx((4 * 0.020 + 0.003) / 2)


def test_a_pipeline_rank_runs_its_stages_blocks_and_the_last_stage_the_edges() -> None:
    layout = Layout("megatron", pp=2, microbatches=2, schedule="1f1b")
    got = compose(layout)
    assert got.forward_s == pytest.approx(2 * 0.010 + 0.001)
    assert got.backward_s == pytest.approx(2 * 0.020 + 0.003)
    assert got.optimizer_step_s == pytest.approx(PER_PARAM * gpu_optimizer_parameters(SHAPE, layout))


def test_recomputation_runs_the_blocks_forward_again_in_backward() -> None:
    full = compose(Layout("fsdp", dp=2, recompute="full"))
    assert full.backward_s == pytest.approx(4 * (0.020 + 0.010) + 0.003)
    share = recompute_share(SHAPE, 128, "selective")
    core = 4 * 192 * 128  # the attention matmuls' forward FLOPs per token (4 x heads x head_dim x T)
    assert share == pytest.approx(core / (2 * SHAPE.block_parameters + core)) and 0 < share < 1
    selective = compose(Layout("megatron", recompute="selective"))
    assert selective.backward_s == pytest.approx(4 * (0.020 + share * 0.010) + 0.003)


def test_another_workload_or_model_is_scaled_by_flops_and_says_so() -> None:
    double = compose(Layout("ddp", dp=2), dataclasses.replace(WORK, micro_batch_size=32, global_batch_size=64))
    assert double.basis == "scaled"
    assert double.forward_s == pytest.approx(2 * (4 * 0.010 + 0.001))  # twice the tokens, same model
    wider = model_shape(dataclasses.replace(NANO, d_model=384, n_heads=12, ffn_hidden=1536))
    got = parts_compute(PARTS, wider, Layout("ddp", dp=2), WORK, wider.num_parameters)
    block_ratio = (6 * wider.block_parameters + 12 * 384 * 128) / (6 * SHAPE.block_parameters + 12 * 192 * 128)
    assert got.basis == "scaled"
    assert got.forward_s == pytest.approx(4 * 0.010 * block_ratio + 0.001 * 2)  # the head's matmul is twice as wide


def test_parts_of_another_precision_or_a_raw_count_do_not_stand_in() -> None:
    assert parts_basis(PARTS, SHAPE, WORK) == "measured"
    assert parts_basis(PARTS, SHAPE, dataclasses.replace(WORK, precision="bf16-mixed")) is None
    assert parts_basis(
        dataclasses.replace(PARTS, precision="fp8"), SHAPE, dataclasses.replace(WORK, precision="bf16-mixed")
    )
    raw = plan(10_000_000, hw_profile("8xh100"), seq_len=128, parts=PARTS)
    assert all(c.estimate.compute_basis == "flops" for c in raw.candidates)
    with pytest.raises(ValueError, match="precision"):
        parts_compute(PARTS, SHAPE, Layout("ddp"), dataclasses.replace(WORK, precision="bf16-true"), 1)


def test_the_step_adds_communication_waits_and_bubble_around_the_measured_parts() -> None:
    hw = hw_profile("8xh100")
    layout = Layout("ddp", dp=2)
    traffic = comm_plan(SHAPE, layout, WORK, hw)
    with_parts = estimate_step(SHAPE, layout, WORK, hw, traffic, DEFAULT_ASSUMPTIONS, PARTS)
    got = compose(layout)
    assert with_parts.compute_basis == "measured"
    assert with_parts.compute_s == pytest.approx(got.forward_s + got.backward_s)
    assert with_parts.optimizer_step_s == pytest.approx(got.optimizer_step_s)
    # No bubble: the step is the measured parts plus the modelled communication and waits, term by term.
    terms = (
        with_parts.compute_s,
        with_parts.optimizer_step_s,
        with_parts.exposed_comm_s,
        with_parts.sync_wait_s,
        with_parts.host_optimizer_s,
        with_parts.host_dispatch_s,
        with_parts.fsdp_host_s,
    )
    assert with_parts.step_time_s == pytest.approx(sum(terms))
    flops = estimate_step(SHAPE, layout, WORK, hw, traffic, DEFAULT_ASSUMPTIONS)
    assert flops.compute_basis == "flops" and flops.compute_s != pytest.approx(with_parts.compute_s)


def test_the_pipeline_bubble_stretches_the_slowest_stages_measured_micro_batches() -> None:
    layout = Layout("megatron", pp=2, microbatches=2, schedule="gpipe")
    estimate = plan_layout(SHAPE, layout, WORK, hw_profile("8xh100"), parts=PARTS).estimate
    stage = compose(layout)
    assert estimate.compute_s == pytest.approx(2 * (stage.forward_s + stage.backward_s))
    assert estimate.bubble_fraction == pytest.approx(1 / 2)  # GPipe: (p - 1) / m
    # The bubble is that fraction of the pipelined micro-batches (their compute and what is exposed beside it).
    assert estimate.compute_s / 2 <= estimate.bubble_s <= (estimate.compute_s + estimate.exposed_comm_s) / 2


def _parts_record(**overrides: object) -> dict:
    record = {
        "micro_batch": 16,
        "seq_len": 128,
        "d_model": 192,
        "vocab_size": 256,
        "block_numel": SHAPE.block_parameters,
        "precision": "fp32",
        "block_forward_s": 0.010,
        "block_backward_s": 0.020,
        "edges_forward_s": 0.001,
        "edges_backward_s": 0.003,
        "optimizer_step_s": 0.002,
    }
    return {**record, **overrides}


def test_calibration_takes_the_median_part_over_ranks_and_the_profile_says_measured(tmp_path: Path) -> None:
    for rank, forward in enumerate((0.010, 0.030, 0.012)):
        writer = TelemetryWriter(tmp_path, rank)
        writer.write("parts_calibration", **_parts_record(block_forward_s=forward))
        writer.close()
    calibration = calibration_from_telemetry(tmp_path)
    assert calibration.parts is not None and calibration.parts["block_forward_s"] == pytest.approx(0.012)
    assert not calibration.empty
    profile = calibrated_profile(hw_profile("cpu"), calibration, "fp32")
    assert profile.parts == dataclasses.replace(PARTS, block_forward_s=0.012)
    basis = profile.basis(SHAPE, WORK)
    assert basis["block_forward_backward"] == basis["optimizer_step"] == "measured"
    no_parts = calibrated_profile(hw_profile("cpu"), Calibration(source="RUN"), "fp32").basis(SHAPE, WORK)
    assert (no_parts["block_forward_backward"], no_parts["optimizer_step"]) == ("flops", "memory_bandwidth")


def test_a_gpu_ranks_memory_figures_reach_the_profile_as_their_median(tmp_path: Path) -> None:
    for rank, kept in enumerate((3e6, 4e6, 2e6)):
        writer = TelemetryWriter(tmp_path, rank)
        writer.write("parts_calibration", **_parts_record(block_activation_bytes=kept, edges_peak_bytes=5e6))
        writer.close()
    profile = calibrated_profile(hw_profile("cpu"), calibration_from_telemetry(tmp_path), "fp32")
    assert profile.parts == MEMORY
    assert profile.basis(SHAPE, WORK)["activations"] == "measured"
    cpu = calibrated_profile(hw_profile("cpu"), Calibration(source="RUN", parts=_parts_record()), "fp32")
    assert cpu.basis(SHAPE, WORK)["activations"] == "formula"


def test_incomplete_parts_records_are_left_out() -> None:
    assert parts_figures([_parts_record(edges_backward_s=None)]) is None
    assert MeasuredParts.from_figures({"block_forward_s": 0.1}) is None
    other_shape = _parts_record(d_model=384, block_forward_s=9.0)
    assert parts_figures([_parts_record(), other_shape])["block_forward_s"] == 0.010


def test_python_m_plan_says_where_the_compute_comes_from() -> None:
    from disttrain.planner.render import compute_line, json_payload

    hw = hw_profile("8xh100")
    measured = plan(NANO, hw, precision="fp32", micro_batch_size=16, global_batch_size=128, parts=PARTS)
    assert compute_line(measured).startswith("compute: the measured parts of this model")
    scaled = plan(NANO, hw, precision="fp32", micro_batch_size=8, global_batch_size=64, parts=PARTS)
    assert "scaled by FLOPs" in compute_line(scaled) and "micro-batch 16 x 128" in compute_line(scaled)
    datasheet = plan(NANO, hw, precision="bf16-mixed", micro_batch_size=16, parts=PARTS)  # parts in fp32: unused
    assert "compute_efficiency 0.55 (an assumption" in compute_line(datasheet)
    assert json_payload(measured, None)["compute_basis"].startswith("the measured parts")


# A GPU probe's allocator bytes: 3 MB kept per block, 5 MB at the edges' peak (at the probe's 16 x 128 tokens).
MEMORY = dataclasses.replace(PARTS, block_activation_bytes=3e6, edges_peak_bytes=5e6)


def activations(layout: Layout, parts: MeasuredParts | None, work: Workload = WORK) -> int:
    return plan_layout(SHAPE, layout, work, hw_profile("8xh100"), DEFAULT_ASSUMPTIONS, parts).memory.activations


def test_a_gpu_probes_bytes_replace_the_activation_formula() -> None:
    assert activations(Layout("ddp", dp=2), MEMORY) == 4 * 3e6 + 5e6  # every block kept, the edges' peak
    assert activations(Layout("fsdp", dp=2), MEMORY) == 4 * 3e6 + 5e6  # sharding keeps a rank's activations
    # Another micro-batch: in proportion to its tokens; tensor parallelism splits them tp ways, as the formula does.
    half = dataclasses.replace(WORK, micro_batch_size=8)
    assert activations(Layout("ddp", dp=2), MEMORY, half) == (4 * 3e6 + 5e6) / 2
    assert activations(Layout("megatron", dp=1, tp=2), MEMORY) == (4 * 3e6 + 5e6) / 2
    # What the probe cannot stand for keeps the formula: recomputed blocks, a CPU's probe (no bytes), another model
    # or precision.
    formula = activations(Layout("ddp", dp=2), None)
    assert activations(Layout("ddp", dp=2), PARTS) == formula != 4 * 3e6 + 5e6
    recomputed = Layout("megatron", dp=1, tp=2, recompute="full")
    assert activations(recomputed, MEMORY) == activations(recomputed, None)
    other = dataclasses.replace(MEMORY, d_model=256)
    assert activations(Layout("ddp", dp=2), other) == formula
    bf16 = dataclasses.replace(WORK, precision="bf16-mixed")
    assert activations(Layout("ddp", dp=2), MEMORY, bf16) == activations(Layout("ddp", dp=2), None, bf16)


def test_measured_bytes_hold_autocasts_weight_copies_so_ddp_does_not_add_them_again() -> None:
    """Under bf16-mixed the matmuls save autocast's 16-bit weight copies for backward: a probe's kept bytes include
    them, so a DDP plan from measured bytes drops the formula's copy term; from the formula it keeps it."""
    bf16 = dataclasses.replace(WORK, precision="bf16-mixed")
    measured = dataclasses.replace(MEMORY, precision="bf16-mixed")

    def memory(parts: MeasuredParts | None, layout: Layout | None = None) -> MemoryBreakdown:
        layout = layout or Layout("ddp", dp=2)
        return plan_layout(SHAPE, layout, bf16, hw_profile("8xh100"), DEFAULT_ASSUMPTIONS, parts).memory

    assert memory(None).buffers == 2 * SHAPE.linear_parameters > 0
    assert memory(measured).buffers == 0 and memory(measured).activations == 4 * 3e6 + 5e6
    # Where the probe's bytes do not stand in (recomputed blocks), the copies stay.
    recomputed = Layout("ddp", dp=2, recompute="full")
    assert memory(measured, recomputed).buffers == memory(None, recomputed).buffers == 2 * SHAPE.linear_parameters


def test_the_memory_figures_travel_through_the_calibration_record() -> None:
    figures = {f.name: getattr(MEMORY, f.name) for f in dataclasses.fields(MeasuredParts)}
    assert MeasuredParts.from_figures(figures) == MEMORY
    older = {k: v for k, v in figures.items() if k not in ("block_activation_bytes", "edges_peak_bytes")}
    assert MeasuredParts.from_figures(older) == PARTS  # a CPU's record, or one written before they were measured


# The parts probe's records of two H200 runs (2026-11-30, gpt2-124m, bf16-mixed, one GPU, CUDA graphs) and the
# allocator peaks those runs reached: micro 16 and 64 x 1024.
H200_GPT2 = {
    16: ({"block_activation_bytes": 444859392.0, "edges_peak_bytes": 3448219648.0}, 9.594),
    64: ({"block_activation_bytes": 1730544640.0, "edges_peak_bytes": 13561047040.0}, 33.388),
}


@pytest.mark.parametrize("micro", sorted(H200_GPT2))
def test_one_gpu_memory_from_the_probes_bytes_meets_the_h200_allocator_peak(micro: int) -> None:
    """On one process (no DDP wrapper) gradients are allocated in backward as activations are freed, and the probe's
    bytes already hold autocast's weight copies: composed so, the prediction meets the measured peak within 1% (the
    additive total stood +7% / +2% above it); two ranks under DDP keep their buckets, and the additive total."""
    from tests.conftest import model_preset

    shape = model_shape(model_preset("gpt2-124m"))
    memory_bytes, peak_gib = H200_GPT2[micro]
    facts = {"d_model": 768, "vocab_size": 50257, "block_numel": shape.block_parameters, "micro_batch": micro}
    parts = dataclasses.replace(PARTS, **facts, **memory_bytes, seq_len=1024, precision="bf16-mixed")
    work = Workload(micro_batch_size=micro, global_batch_size=micro, seq_len=1024, precision="bf16-mixed")

    def memory(layout: Layout) -> MemoryBreakdown:
        return plan_layout(shape, layout, work, hw_profile("8xh200"), DEFAULT_ASSUMPTIONS, parts).memory

    one = memory(Layout("ddp", dp=1))
    assert abs(one.total / 2**30 / peak_gib - 1) < 0.01, one
    assert one.grads_in_backward and one.buffers == 0
    two = memory(Layout("ddp", dp=2))
    assert not two.grads_in_backward and two.total == one.total + one.grads
