"""The start-up parts probe on a tiny model: what it records, in the run's precision, and that the planner reads it."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from diagnostics.calibration import calibration_from_telemetry
from diagnostics.collect.callback import DiagnosticsCallback
from diagnostics.collect.parts import time_model_parts
from diagnostics.collect.run_facts import CollectSettings, RunFacts
from diagnostics.telemetry import RECORD_FIELDS, TelemetryWriter, telemetry_path
from disttrain.config.schema import CUDAGRAPH_MODES, OptimizerConfig
from disttrain.models.probe_parts import WITHOUT_GRAPHS, model_parts, probe_compiles
from disttrain.planner.measured import MeasuredParts
from disttrain.planner.shapes import model_shape
from tests.conftest import model_preset

pytestmark = pytest.mark.exclusive  # upper bounds on timed parts: run alone

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


def test_the_probes_optimizer_steps_are_hidden_from_global_optimizer_hooks() -> None:
    """A user's hook registered for every optimizer (one that counts the run's steps) must not count the probe's."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    seen: list[object] = []
    handle = register_optimizer_step_post_hook(lambda optimizer, *_: seen.append(optimizer))
    try:
        parts = model_parts(TINY, OptimizerConfig(), "fp32", torch.device("cpu"))
        block = parts["block"]
        before = [p.detach().clone() for p in block.parameters()]
        assert time_model_parts(torch.device("cpu"), parts, micro_batch=2)["optimizer_step_s"] > 0
        assert seen == []
        assert any(not torch.equal(a, p) for a, p in zip(before, block.parameters(), strict=True))  # it did step
    finally:
        handle.remove()


def test_an_hf_model_is_probed_at_two_layers_of_its_own_config_with_each_part_where_its_time_goes() -> None:
    """The HF probe times the decoder layers inside the model's own passes: time spent in a layer is block time,
    time in the final norm is edge time, whichever the model spends it in."""
    from disttrain.config.hf import hf_shape
    from disttrain.config.schema import HFModelConfig
    from disttrain.models.probe_parts import PROBE_LAYERS, hf_model_parts

    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 2}
    config = {"model_type": "llama", **shape, "num_key_value_heads": 1, "vocab_size": 64, "max_position_embeddings": 64}
    model = HFModelConfig(config=config, seq_len=16)
    parts = hf_model_parts(model, OptimizerConfig(), "fp32", torch.device("cpu"))
    assert len(parts["layers"]) == PROBE_LAYERS
    assert parts["block_numel"] == model_shape(hf_shape(model)).block_parameters
    quick = time_model_parts(torch.device("cpu"), parts, micro_batch=2, repeats=3)
    assert all(quick[k] > 0 for k in ("block_forward_s", "block_backward_s", "edges_forward_s", "optimizer_step_s"))
    assert quick["block_forward_s"] < 0.01 and quick["edges_forward_s"] < 0.01
    # A part the 20 ms sleep is not in never holds it whole (a loaded box stretches an unslept part by some ms).
    unslept = 0.02

    def sleep(*_: object) -> None:
        time.sleep(0.02)

    base = parts["model"].hf.model
    handles = [base.norm.register_forward_hook(sleep)]  # the edges' own module
    edges_slow = time_model_parts(torch.device("cpu"), parts, micro_batch=2, repeats=3)
    assert edges_slow["edges_forward_s"] >= 0.02 and edges_slow["block_forward_s"] < unslept
    handles[0].remove()
    handles = [layer.mlp.register_forward_hook(sleep) for layer in parts["layers"]]  # inside each layer
    block_slow = time_model_parts(torch.device("cpu"), parts, micro_batch=2, repeats=3)
    assert block_slow["block_forward_s"] >= 0.02 and block_slow["edges_forward_s"] < unslept
    for handle in handles:
        handle.remove()


def test_a_run_that_compiles_its_blocks_has_them_timed_compiled_and_its_loss_as_the_run_computes_it() -> None:
    """model.compile=true: the probe times the block compiled (the run's blocks then reuse the compiled code) after a
    warm-up pass for the compile; CUDA-graph modes and eager runs keep the eager block. On 2 CPU ranks of gpt-nano,
    compiled, two interleaved repeats: the compiled probe's prediction read -3.3/-3.8%, the eager one's +7.6/+5.2%."""
    from torch._dynamo.eval_frame import OptimizedModule

    from disttrain.models.module import compiled_next_token_loss, next_token_loss

    cpu = torch.device("cpu")
    compiled = model_parts(dataclasses.replace(TINY, compile=True), OptimizerConfig(), "fp32", cpu)
    assert isinstance(compiled["block"], OptimizedModule) and compiled["compiled"] == "default"
    assert compiled["warmup"] == 2 and compiled["loss"] is compiled_next_token_loss()
    graphs = dataclasses.replace(TINY, compile=True, compile_mode="reduce-overhead")
    for cfg in (TINY, graphs):
        parts = model_parts(cfg, OptimizerConfig(), "fp32", cpu)
        assert not isinstance(parts["block"], OptimizedModule) and parts["compiled"] is None
        assert not parts["gpu_clock"]
    # On a GPU a CUDA-graph run's block is compiled without graphs (the same kernels) and timed on the GPU's clock.
    assert probe_compiles(graphs, torch.device("cuda")) and not probe_compiles(graphs, cpu)
    assert probe_compiles(dataclasses.replace(graphs, compile_mode="max-autotune"), torch.device("cuda"))
    assert not probe_compiles(dataclasses.replace(graphs, compile=False), torch.device("cuda"))
    assert all(WITHOUT_GRAPHS[mode] not in CUDAGRAPH_MODES for mode in CUDAGRAPH_MODES)  # every graph mode, none left
    assert model_parts(TINY, OptimizerConfig(), "fp32", cpu)["loss"] is next_token_loss

    calls: list[str] = []
    parts = model_parts(TINY, OptimizerConfig(), "fp32", cpu)
    eager_loss = parts["loss"]

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        calls.append("loss")
        return eager_loss(logits, targets)

    parts.update(loss=loss, warmup=3, compiled="default")
    result = time_model_parts(cpu, parts, micro_batch=2, repeats=2)
    assert calls == ["loss"] * 5  # 3 warm-up passes of the edges, then the 2 timed
    assert result["compiled"] == "default"


def test_parts_on_the_gpus_clock_are_read_from_events_between_segments_after_a_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The held-GPU timing (CUDA-graph runs): one hold sized from the host's queueing bound, then each segment's
    seconds between the events around it, per repeat. CUDA's events and sleep stand in as host clocks here."""
    from diagnostics.collect import parts as probe

    holds: list[int] = []

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing

        def record(self) -> None:
            self.at = time.perf_counter()

        def elapsed_time(self, later: Event) -> float:
            return 1e3 * (later.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", holds.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    order: list[str] = []

    def segment(name: str, seconds: float):
        def run() -> None:
            order.append(name)
            time.sleep(seconds)

        return run

    short, long = probe._held_gpu_seconds([segment("a", 0.002), segment("b", 0.02)], repeats=3, queue_s=0.01)
    assert order == ["a", "b"] * 3 and len(short) == len(long) == 3
    assert all(0.002 <= s < 0.015 for s in short) and all(0.02 <= s < 0.05 for s in long)
    assert holds == [int(probe.HOLD_CYCLES_PER_S * 1.5 * 0.01 * 3)]

    outputs = []  # forward, then backward of what that forward returned
    x = torch.ones(3, requires_grad=True)

    def forward() -> torch.Tensor:
        outputs.append(x * 2)
        return outputs[-1]

    forward_s, backward_s = probe._gpu_clock_passes(forward, repeats=2, queue_s=0.001)
    assert len(forward_s) == len(backward_s) == 2 and x.grad is not None and x.grad.tolist() == [4.0, 4.0, 4.0]


def test_the_start_up_probes_leave_the_runs_random_streams_as_they_found_them(tmp_path: Path) -> None:
    """Switching diagnostics on must not change the training: the parts probe seeds and draws torch's generator,
    the run's dropout and data must not see it."""
    facts = RunFacts(
        *("ddp", "fp32", "fp32", "cpu", 10, 60.0, 60.0, 64, 2, 1, 32, 10, None),
        parts_probe=lambda device: model_parts(TINY, OptimizerConfig(), "fp32", device),
    )
    callback = DiagnosticsCallback(CollectSettings(), facts, tmp_path, lambda: None)
    torch.manual_seed(1)
    untouched = torch.rand(4)
    torch.manual_seed(1)
    callback.calibrate_parts(torch.device("cpu"))  # the probe alone does draw: without the fork the stream moves
    assert not torch.equal(torch.rand(4), untouched)
    torch.manual_seed(1)
    trainer = SimpleNamespace(global_rank=0, local_rank=0, world_size=1, num_nodes=1, num_devices=1)
    callback.setup(trainer, SimpleNamespace(device=torch.device("cpu")), "fit")  # type: ignore[arg-type]
    try:
        assert torch.equal(torch.rand(4), untouched)
    finally:
        callback.teardown_collectors()
        callback.writer.close()
    records = [json.loads(line) for line in telemetry_path(tmp_path, 0).read_text().splitlines()]
    assert {"calibration", "parts_calibration"} <= {r["kind"] for r in records}


def test_an_eager_block_on_a_cpu_is_warmed_up_before_it_is_timed() -> None:
    """A fresh process's first passes read slow on a CPU: an eager block (one warm-up pass asked for) and its edges
    each get CPU_WARMUP_PASSES untimed passes before the timed ones."""
    from diagnostics.collect.parts import CPU_WARMUP_PASSES

    parts = model_parts(TINY, OptimizerConfig(), "fp32", torch.device("cpu"))
    assert parts["warmup"] == 1 and CPU_WARMUP_PASSES > 1
    eager_loss, block = parts["loss"], parts["block"]
    losses: list[int] = []
    blocks: list[int] = []
    block.register_forward_hook(lambda *_: blocks.append(1))
    parts["loss"] = lambda logits, targets: losses.append(1) or eager_loss(logits, targets)
    time_model_parts(torch.device("cpu"), parts, micro_batch=2, repeats=2)
    assert len(blocks) == len(losses) == CPU_WARMUP_PASSES + 2
