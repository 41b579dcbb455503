"""The start-up parts probe on a GPU: gpt2-124m's block, edges and block optimizer step in bf16-mixed are timed, their
allocator bytes measured, and the allocator's peak is reset after it (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from diagnostics.collect.parts import time_model_parts
from disttrain.config.schema import OptimizerConfig
from disttrain.models.probe_parts import model_parts
from tests.conftest import model_preset

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_gpt2_parts_are_timed_in_bf16_and_leave_no_peak_behind() -> None:
    device = torch.device("cuda", 0)
    parts = model_parts(model_preset("gpt2-124m"), OptimizerConfig(), "bf16-mixed", device)
    result = time_model_parts(device, parts, micro_batch=4)
    seconds = [result[k] for k in ("block_forward_s", "block_backward_s", "edges_forward_s", "edges_backward_s")]
    assert all(0 < s < 1.0 for s in seconds), result
    assert result["block_backward_s"] > result["block_forward_s"]  # backward runs about twice the matmuls
    assert 0 < result["optimizer_step_s"] < 0.1 and result["block_numel"] == 7_087_872
    assert torch.cuda.max_memory_allocated(device) < 2 * 2**30  # the probe's 4 x 1024 x 50257 logits are gone
    # The allocator's bytes the planner composes activations from: a block keeps its saved tensors (Korthikanti et
    # al.'s 34 x s x b x h bytes all in 16 bits, less with flash attention; autocast keeps the norms' inputs and the
    # residual stream in fp32: 45.7 x s x b x h eager on an H200, 2026-11-30) and the edges peak above the logits'
    # bf16 bytes (the loss works in fp32).
    tokens, width = 4 * 1024, 768
    assert 4 * tokens * width < result["block_activation_bytes"] < 64 * tokens * width, result
    assert result["edges_peak_bytes"] > 2 * tokens * 50257, result


def test_a_cuda_graph_runs_block_is_timed_compiled_on_the_gpus_clock() -> None:
    """model.compile_mode=reduce-overhead: the block compiled without graphs, its passes read from CUDA events with
    the host running ahead (the kernels' time, as a replay runs them): less than the eager block's wall time."""
    import dataclasses

    device = torch.device("cuda", 0)
    gpt2 = model_preset("gpt2-124m")
    eager = time_model_parts(device, model_parts(gpt2, OptimizerConfig(), "bf16-mixed", device), micro_batch=8)
    graphs = dataclasses.replace(gpt2, compile=True, compile_mode="reduce-overhead")
    parts = model_parts(graphs, OptimizerConfig(), "bf16-mixed", device)
    assert parts["gpu_clock"] and parts["compiled"] == "reduce-overhead"
    result = time_model_parts(device, parts, micro_batch=8)
    assert result["clock"] == "gpu" and eager["clock"] == "wall"
    assert 0 < result["block_forward_s"] < result["block_backward_s"], result
    block = result["block_forward_s"] + result["block_backward_s"]
    assert block < eager["block_forward_s"] + eager["block_backward_s"], (result, eager)
    assert 4 * 8 * 1024 * 768 < result["block_activation_bytes"] < 64 * 8 * 1024 * 768, result


def test_an_hf_llamas_layers_are_timed_inside_its_passes_on_the_gpu() -> None:
    """The HF probe's hooks synchronize the device: a layer's time is its kernels', not their launch."""
    from disttrain.config.hf import hf_shape
    from disttrain.config.schema import HFModelConfig
    from disttrain.models.probe_parts import hf_model_parts
    from disttrain.planner.shapes import model_shape

    config = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
              "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000}  # fmt: skip
    model = HFModelConfig(config=config, seq_len=1024)
    device = torch.device("cuda", 0)
    parts = hf_model_parts(model, OptimizerConfig(), "bf16-mixed", device)
    assert parts["block_numel"] == model_shape(hf_shape(model)).block_parameters
    result = time_model_parts(device, parts, micro_batch=4)
    assert 0 < result["block_forward_s"] < result["block_backward_s"] < 1.0, result
    assert 0 < result["edges_forward_s"] < 1.0 and 0 < result["optimizer_step_s"] < 0.1
