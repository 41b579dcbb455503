"""DeepSpeed ZeRO-1/2's host work (``hw.zero_*``, measured by ``diagnostics.collect.zero_step`` on a copy of the run's
model): which runs the probe builds, how calibration reads its records back, and what the planner charges for it
(the real probe on 2 gloo ranks: tests/dist/test_deepspeed.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from diagnostics.calibration import calibration_from_telemetry
from diagnostics.telemetry import TelemetryWriter
from disttrain.config.errors import ConfigError
from disttrain.config.hardware import validate_profile
from disttrain.config.schema import CustomModelConfig, HFModelConfig, PrecisionConfig
from disttrain.config.strategy_schema import DeepSpeedConfig
from disttrain.planner import Layout, Workload, model_shape, plan_layout
from disttrain.planner.calibrated import calibrated_profile
from disttrain.strategies.zero_probe import zero_probe_supported
from tests.conftest import hw_profile as hw
from tests.conftest import model_preset as model
from tests.hf_fixtures import TINY_LLAMA

CPU = dataclasses.replace(
    hw("cpu"),
    devices_per_node=4,  # dp=4 on one host
    peak_tflops={"fp32": 0.05},
    hbm_bandwidth_gbps=20.0,
    intra_node_bandwidth_gbps=1.0,
    intra_node_latency_us=200.0,
)
MEASURED = dataclasses.replace(
    CPU,
    zero_backward_fixed_us=1000.0,
    zero_backward_ns_per_byte=3.0,
    zero_step_fixed_us=1200.0,
    zero_step_ns_per_byte=0.5,
)


def work(micro: int, global_batch: int) -> Workload:
    return Workload(global_batch_size=global_batch, micro_batch_size=micro, seq_len=128, precision="fp32")


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_2_pay_the_hooks_each_micro_batch_and_the_step_over_their_partition(
    dp: int, accumulation: int, stage: int
) -> None:
    shape = model_shape(model("gpt-micro"))
    workload = work(8, 8 * dp * accumulation)
    layout = Layout("deepspeed", dp=dp, zero_stage=stage, microbatches=accumulation)
    model_bytes = 4 * shape.num_parameters
    per_micro_batch = 1000e-6 + model_bytes * 3.0e-9
    per_step = 1200e-6 + model_bytes / dp * 0.5e-9
    assert layout.terms.engine_host_seconds(shape, layout, workload, MEASURED) == pytest.approx(
        (per_micro_batch, per_step)
    )
    before = plan_layout(shape, layout, workload, CPU).estimate
    after = plan_layout(shape, layout, workload, MEASURED).estimate
    expected = accumulation * per_micro_batch + per_step
    assert before.zero_host_s == 0.0 and after.zero_host_s == pytest.approx(expected)
    assert after.step_time_s - before.step_time_s == pytest.approx(expected)


def test_only_a_zero_1_2_engine_without_offload_is_charged() -> None:
    shape, workload = model_shape(model("gpt-micro")), work(8, 16)
    zero2 = Layout("deepspeed", dp=2, zero_stage=2)
    assert zero2.terms.engine_host_seconds(shape, zero2, workload, CPU) == (0.0, 0.0)
    for layout in (
        Layout("ddp", dp=2),
        Layout("fsdp", dp=2),
        Layout("deepspeed", dp=2, zero_stage=3),  # partitioned parameters: another engine, not the probe's
        Layout("deepspeed", dp=2, zero_stage=2, offload_optimizer=True),  # the step runs on the host's Adam
        Layout("megatron", tp=2),
    ):
        assert layout.terms.engine_host_seconds(shape, layout, workload, MEASURED) == (0.0, 0.0), layout
        assert plan_layout(shape, layout, workload, MEASURED).estimate.zero_host_s == 0.0
    with pytest.raises(ConfigError, match=r"hw.zero_backward_ns_per_byte: must be >= 0"):
        validate_profile(dataclasses.replace(CPU, zero_backward_ns_per_byte=-1.0))


def test_the_probe_builds_the_runs_engine_only_where_its_plain_twin_runs_the_same_math() -> None:
    micro, zero2, fp32 = model("gpt-micro"), DeepSpeedConfig(stage=2), PrecisionConfig(name="fp32")
    assert zero_probe_supported(micro, zero2, fp32, compiled=False)
    assert zero_probe_supported(micro, DeepSpeedConfig(stage=1), fp32, compiled=False)
    llama = HFModelConfig(config=dict(TINY_LLAMA), seq_len=32)
    assert zero_probe_supported(llama, zero2, fp32, compiled=False)
    refused = [
        (micro, zero2, PrecisionConfig(name="bf16-mixed"), False),  # DeepSpeed's bf16 engine keeps an fp32 master
        (micro, zero2, fp32, True),  # compiled blocks
        (model("moe-micro"), zero2, fp32, False),  # experts
        (micro, DeepSpeedConfig(stage=3), fp32, False),
        (micro, DeepSpeedConfig(stage=2, offload_optimizer="cpu"), fp32, False),
        (micro, DeepSpeedConfig(stage=2, activation_checkpointing=True), fp32, False),
        (CustomModelConfig(target="my.Model", vocab_size=64, seq_len=16), zero2, fp32, False),  # layers unknown
    ]
    for args in refused:
        assert not zero_probe_supported(*args), args


def test_the_ranks_zero_figures_are_read_back_as_medians_and_substituted(tmp_path: Path) -> None:
    figures = [(900.0, 2.0, 1100.0, 0.0), (1100.0, 4.0, 1300.0, 0.2), (1000.0, 3.0, None, 0.1)]
    for rank, (backward_fixed, backward_ns, step_fixed, step_ns) in enumerate(figures):
        w = TelemetryWriter(tmp_path, rank)
        w.write("calibration", when="start", dtype="fp32", matrix_size=512, flops_per_s=9e10, seconds=0.15)
        w.write(
            "zero_calibration", dp=3, param_bytes=925_184, backward_fixed_us=backward_fixed,
            backward_ns_per_byte=backward_ns, step_fixed_us=step_fixed, step_ns_per_byte=step_ns,
        )  # fmt: skip
        w.close()
    cal = calibration_from_telemetry(tmp_path)
    assert (cal.zero_backward_fixed_us, cal.zero_backward_ns_per_byte) == (pytest.approx(1000.0), pytest.approx(3.0))
    assert (cal.zero_step_fixed_us, cal.zero_step_ns_per_byte) == (pytest.approx(1200.0), pytest.approx(0.1))
    profile = calibrated_profile(hw("cpu"), cal, "fp32")
    assert profile.hw.zero_backward_ns_per_byte == pytest.approx(3.0) and profile.hw.zero_step_fixed_us == 1200.0
    assert all(profile.sources[f"zero_{name}"] == "measured" for name in ("backward_fixed_us", "step_ns_per_byte"))
    assert calibrated_profile(hw("cpu"), None, "fp32").sources["zero_step_fixed_us"] == "none"
