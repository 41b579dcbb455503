"""FSDP2's sharded parameters in the step's tail: the probe's per-tensor and per-step host cost
(``diagnostics.collect.fsdp_step``), its calibration figures, and the planner charging them to the optimizer step
of every layout whose parameters FSDP2 shards (not DDP's, DeepSpeed's, nor tensor parallelism's, measured apart)."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from diagnostics.calibration import calibration_from_telemetry
from diagnostics.collect.fsdp_step import fsdp_step_overhead
from diagnostics.telemetry import TelemetryWriter
from disttrain.config.errors import ConfigError
from disttrain.config.hardware import validate_profile
from disttrain.config.schema import OptimizerConfig
from disttrain.planner import Layout, comm_plan, model_shape, plan_layout
from disttrain.planner.calibrated import calibrated_profile
from disttrain.planner.shapes import count_shape
from disttrain.training.step_tail import step_tail
from tests.conftest import hw_profile as hw
from tests.conftest import model_preset as model
from tests.unit.test_planner_host_terms import CPU, WORK, one_rank_group


def test_the_rank_s_sharded_parameter_tensors_are_counted_per_layout() -> None:
    nano = model_shape(model("gpt-nano"))
    per_block, root = len(nano.block), len(nano.embedding + nano.head)
    assert comm_plan(nano, Layout("fsdp", dp=2), WORK, CPU).step_fsdp_tensors == nano.n_layers * per_block + root
    # strategy=megatron wraps its chunks in FSDP2 even over one rank: a pipeline stage holds half the blocks and
    # its own end of the model (the last stage's head and final norm outnumber the first's embedding)
    box = dataclasses.replace(CPU, devices_per_node=4)
    pp2 = Layout("megatron", pp=2, microbatches=2, schedule="1f1b")
    last = nano.n_layers // 2 * per_block + len(nano.stage_root(2, 1))
    assert comm_plan(nano, pp2, WORK, box).step_fsdp_tensors == last
    # tensor parallelism's DTensor tail is its own probe's; DDP and DeepSpeed hold plain tensors
    for other in (Layout("megatron", tp=2), Layout("ddp", dp=2), Layout("deepspeed", dp=2, zero_stage=2)):
        assert comm_plan(nano, other, WORK, box).step_fsdp_tensors == 0.0
    # a raw parameter count has no tensors to count
    assert comm_plan(count_shape(10**6, 128), Layout("fsdp", dp=2), WORK, CPU).step_fsdp_tensors == 0.0


def test_the_measured_step_tail_lengthens_the_optimizer_step_of_fsdp_layouts_only() -> None:
    nano = model_shape(model("gpt-nano"))
    box = dataclasses.replace(CPU, devices_per_node=4)
    measured = dataclasses.replace(box, fsdp_step_tensor_us=150.0, fsdp_step_fixed_us=1000.0)
    for layout in (Layout("fsdp", dp=2), Layout("megatron", pp=2, microbatches=2, schedule="1f1b")):
        tensors = comm_plan(nano, layout, WORK, box).step_fsdp_tensors
        before = plan_layout(nano, layout, WORK, box).estimate
        after = plan_layout(nano, layout, WORK, measured).estimate
        expected = tensors * 150e-6 + 1e-3
        assert after.optimizer_step_s - before.optimizer_step_s == pytest.approx(expected) and tensors > 0
        assert after.step_time_s - before.step_time_s == pytest.approx(expected)
    for plain in (Layout("ddp", dp=2), Layout("megatron", tp=2), Layout("deepspeed", dp=2, zero_stage=2)):
        assert plan_layout(nano, plain, WORK, measured).estimate == plan_layout(nano, plain, WORK, box).estimate
    for name in ("fsdp_step_tensor_us", "fsdp_step_fixed_us"):
        with pytest.raises(ConfigError, match=rf"hw.{name}: must be >= 0"):
            validate_profile(dataclasses.replace(CPU, **{name: -1.0}))


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds  # the probe reads the thread's CPU clock: a sleep would not count
    while time.thread_time() < end:
        pass


def _known_tail(per_tensor_s: float, per_step_s: float) -> Callable[[torch.nn.Module], Callable[[], None]]:
    """A step tail that costs ``per_tensor_s`` per sharded parameter and ``per_step_s`` once if any is sharded,
    nothing over plain parameters."""

    def build(module: torch.nn.Module) -> Callable[[], None]:
        sharded = sum(isinstance(p, DTensor) for p in module.parameters())
        return functools.partial(_spin, sharded * per_tensor_s + (per_step_s if sharded else 0.0))

    return build


def test_the_probe_separates_a_per_tensor_cost_from_a_per_step_one(tmp_path: Path) -> None:
    with one_rank_group(tmp_path / "store"):
        result = fsdp_step_overhead(torch.device("cpu"), 1, _known_tail(300e-6, 2e-3), repeats=3)
    assert set(result["step_extra_s"]) == {"8", "24"}  # units of 4 and 12 linears: weight and bias each
    assert result["step_tensor_us"] == pytest.approx(300.0, rel=0.1)
    assert result["step_fixed_us"] == pytest.approx(2000.0, rel=0.1)


def test_the_runs_own_tail_costs_more_over_sharded_parameters(tmp_path: Path) -> None:
    with one_rank_group(tmp_path / "store"):
        result = fsdp_step_overhead(torch.device("cpu"), 1, functools.partial(step_tail, optimizer=OptimizerConfig()))
    # DTensor dispatches every op per tensor even over one rank (~100-200 us per tensor on this box's cores)
    assert result["step_tensor_us"] > 10
    assert result["step_extra_s"]["24"] > result["step_extra_s"]["8"] > 0


def test_the_figures_are_read_back_as_medians_over_ranks_and_substituted(tmp_path: Path) -> None:
    for rank, (per_tensor, fixed) in enumerate([(140.0, 900.0), (160.0, 1100.0), (500.0, 1000.0)]):
        w = TelemetryWriter(tmp_path, rank)
        w.write("calibration", when="start", dtype="fp32", matrix_size=512, flops_per_s=9e10, seconds=0.15)
        w.write("fsdp_calibration", ranks=3, fixed_us=700.0, ns_per_byte=0.3, step_tensor_us=per_tensor,
                step_fixed_us=fixed)  # fmt: skip
        w.close()
    cal = calibration_from_telemetry(tmp_path)
    assert (cal.fsdp_step_tensor_us, cal.fsdp_step_fixed_us) == (160.0, 1000.0)
    profile = calibrated_profile(hw("cpu"), cal, "fp32")
    assert (profile.hw.fsdp_step_tensor_us, profile.hw.fsdp_step_fixed_us) == (160.0, 1000.0)
    assert profile.sources["fsdp_step_tensor_us"] == profile.sources["fsdp_step_fixed_us"] == "measured"


def test_the_probes_tail_steps_without_firing_the_users_global_optimizer_hooks() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    seen: list[str] = []
    handles = [
        register_optimizer_step_pre_hook(lambda *_: seen.append("pre")),
        register_optimizer_step_post_hook(lambda *_: seen.append("post")),
    ]
    try:
        module = torch.nn.Linear(4, 4)
        for p in module.parameters():
            p.grad = torch.ones_like(p)
        before = module.weight.detach().clone()
        tail = step_tail(module, OptimizerConfig())
        tail()
        tail()
        assert seen == []  # a hook that counts the run's steps (tests/plugins.py's phase plan does) sees none
        assert not torch.equal(module.weight, before)  # but AdamW did step
        torch.optim.AdamW(module.parameters()).step()
        assert seen == ["pre", "post"]  # the hooks were live all along
    finally:
        for handle in handles:
            handle.remove()
