"""ZeRO model states against DeepSpeed's own estimators, byte for byte where the planner models the same thing.

``estimate_zero2_model_states_mem_needs_all_cold`` / ``estimate_zero3_model_states_mem_needs_all_cold`` print a
table of the per-GPU and per-node CPU bytes their ``estimate_*_model_states_mem_needs`` return. The planner's
counterpart of their GPU figure is params + grads + optimizer states + the fp32 gradient partition (and stage 3's
4 bytes x the largest layer); the differences it keeps on purpose are listed in ``_deepspeed_states``.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from disttrain.planner import Layout, Workload, count_shape, model_shape, model_state_bytes, plan
from tests.conftest import hw_profile as hw
from tests.conftest import model_preset

zero = pytest.importorskip("deepspeed.runtime.zero")
from deepspeed.runtime.zero.stage3 import (  # noqa: E402
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
)
from deepspeed.runtime.zero.stage_1_and_2 import (  # noqa: E402
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
)

GIB = 2**30
LLAMA_70B = model_shape(model_preset("llama-70b"))
ONE_T = count_shape(10**12, seq_len=2048)


def gpu_model_states(shape, layout: Layout) -> int:
    """What DeepSpeed's estimator calls the GPU's model states (the buckets are left out, as it does)."""
    m = model_state_bytes(shape, layout, Workload(1, layout.dp, 2048, "bf16-mixed"))
    fp32_grads = 0 if layout.offload_optimizer else 4 * -(-shape.num_parameters // layout.dp)
    largest = 4 * shape.largest_module_parameters if layout.zero_stage == 3 else 0
    return m.params + m.grads + m.optimizer_states + fp32_grads + largest


def estimator_zero3(**options) -> Layout:
    """ZeRO-3 as DeepSpeed's estimator assumes it: every parameter partitioned (no persistence threshold)."""
    return Layout("deepspeed", zero_stage=3, persistence_threshold=0, **options)


def printed_rows(capsys) -> list[tuple[float, float, str]]:
    rows = re.findall(r"^\s+([0-9.]+)GB \|\s+([0-9.]+)GB \| (.*)$", capsys.readouterr().out, re.MULTILINE)
    return [(float(cpu), float(gpu), options) for cpu, gpu, options in rows]


@pytest.mark.parametrize("shape", [LLAMA_70B, ONE_T], ids=["llama-70b", "1T"])
@pytest.mark.parametrize(("nodes", "per_node"), [(1, 8), (2, 8), (16, 8)])
def test_zero2_gpu_bytes_equal_deepspeeds_estimator(shape, nodes: int, per_node: int, capsys) -> None:
    dp = nodes * per_node
    for offload in (True, False):
        _, gpu = estimate_zero2_model_states_mem_needs(shape.num_parameters, per_node, nodes, cpu_offload=offload)
        assert gpu_model_states(shape, Layout("deepspeed", dp=dp, zero_stage=2, offload_optimizer=offload)) == gpu
    estimate_zero2_model_states_mem_needs_all_cold(shape.num_parameters, per_node, nodes)
    rows = printed_rows(capsys)  # offload_optimizer=cpu, then none
    for row, offload in zip(rows, (True, False), strict=True):
        layout = Layout("deepspeed", dp=dp, zero_stage=2, offload_optimizer=offload)
        assert row[1] == round(gpu_model_states(shape, layout) / GIB, 2), row


@pytest.mark.parametrize("shape", [LLAMA_70B, ONE_T], ids=["llama-70b", "1T"])
@pytest.mark.parametrize(("nodes", "per_node"), [(1, 8), (2, 8), (16, 8)])
def test_zero3_offload_gpu_and_host_bytes_equal_deepspeeds_estimator(shape, nodes: int, per_node: int, capsys) -> None:
    dp, n, largest = nodes * per_node, shape.num_parameters, shape.largest_module_parameters
    for offload_params in (True, False):
        layout = estimator_zero3(dp=dp, offload_optimizer=True, offload_params=offload_params)
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(n, largest, per_node, nodes, True, offload_params, True)
        assert gpu_model_states(shape, layout) == gpu
        # The estimator's CPU column is per node with a 1.5 safety factor (zero.Init: no full-model load).
        host = model_state_bytes(shape, layout, Workload(1, dp, 2048, "bf16-mixed")).host
        assert host * per_node * 1.5 == cpu
    estimate_zero3_model_states_mem_needs_all_cold(n, largest, per_node, nodes)
    rows = printed_rows(capsys)  # (param, optimizer offload) = (cpu, cpu) x zero_init 1/0, then (none, cpu) x 1/0
    for row, offload_params in zip(rows[:4], (True, True, False, False), strict=True):
        layout = estimator_zero3(dp=dp, offload_optimizer=True, offload_params=offload_params)
        assert row[1] == round(gpu_model_states(shape, layout) / GIB, 2), row


def test_zero3_without_offload_keeps_the_16bit_gradient_partition_deepspeeds_estimator_leaves_out() -> None:
    dp, n = 8, LLAMA_70B.num_parameters
    _, gpu, _ = estimate_zero3_model_states_mem_needs(n, LLAMA_70B.largest_module_parameters, dp, 1, False, False)
    assert gpu_model_states(LLAMA_70B, estimator_zero3(dp=dp)) - gpu == 2 * n // dp
    # What the estimator leaves out too: the parameters under the persistence threshold (llama-70b's norms), whole
    # on every rank beside their partition.
    persistent = LLAMA_70B.small_parameters(100_000)
    assert persistent == (2 * 80 + 1) * 8192
    with_persistent = gpu_model_states(LLAMA_70B, Layout("deepspeed", dp=dp, zero_stage=3))
    assert with_persistent - gpu_model_states(LLAMA_70B, estimator_zero3(dp=dp)) == 2 * persistent


def test_llama70b_zero3_with_parameter_and_optimizer_offload_keeps_no_gradients_on_the_gpu() -> None:
    layout = Layout("deepspeed", dp=8, zero_stage=3, offload_optimizer=True, offload_params=True)
    memory = model_state_bytes(LLAMA_70B, layout, Workload(1, 8, 4096, "bf16-mixed"))
    # Only the persistent parameters (the norms, 16-bit) stay on the GPU.
    assert (memory.params, memory.grads, memory.optimizer_states) == (2 * LLAMA_70B.small_parameters(100_000), 0, 0)
    # The working set only: the largest layer (4 bytes/element) and Lightning's reduce/all-gather buckets.
    assert memory.buffers == 4 * LLAMA_70B.largest_module_parameters + 4 * 200_000_000 + 2 * 200_000_000
    stage1 = model_state_bytes(LLAMA_70B, Layout("deepspeed", dp=8, zero_stage=1, offload_optimizer=True),
                               Workload(1, 8, 4096, "bf16-mixed"))  # fmt: skip
    assert stage1.grads == 2 * LLAMA_70B.num_parameters  # stage 1 accumulates unpartitioned 16-bit gradients


def test_1t_on_8xa100_fits_zero3_with_parameter_and_optimizer_offload_given_the_host_memory() -> None:
    # The GPUs hold no model states, but 8 x ~2.1 TiB of offloaded states overflow a DGX A100's 2 TiB of host
    # memory (ZeRO-Infinity puts them on NVMe, which the planner does not model): only a bigger host fits it.
    dgx = plan(10**12, hw("8xa100"), seq_len=2048)
    both = {c.label: c for c in dgx.candidates}["ZeRO-3 +offload(opt,param)"]
    assert both.memory.grads == 0 and both.memory.total < 2 * 2**30 and both.memory.host > 2000 * 2**30
    assert not both.fits and any("hw.host_memory_gib" in note for note in both.notes)
    result = plan(10**12, dataclasses.replace(hw("8xa100"), host_memory_gib=32 * 1024), seq_len=2048)
    by_label = {c.label: c for c in result.candidates}
    assert by_label["ZeRO-3 +offload(opt,param)"].fits
    assert by_label["ZeRO-3 +offload(opt)"].memory.grads == 0
    # FSDP2 without resharding holds the whole bf16 model: it was recommended at 0.0 GiB per GPU.
    assert not by_label["FSDP2 full shard no-reshard +cpu-offload"].fits
    assert result.recommended is not None and "no-reshard" not in result.recommended.label
