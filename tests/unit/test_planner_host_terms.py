"""Host-side terms calibration measures: how much of an overlappable collective compute hides (``comm_overlap``),
the host cost of each tensor-parallel (DTensor) module (``tp_linear_overhead_us``), of each FSDP2 unit and the bytes
it copies (``fsdp_unit_overhead_us``, ``fsdp_copy_ns_per_byte``), and a matmul rate on the CPU clock of the compute
(what the cores do, not the share other processes leave them)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from diagnostics.calibration import calibration_from_telemetry
from diagnostics.collect.calibrate import compute_clock, runqueue_seconds
from diagnostics.collect.calibrate_parallel import (
    fsdp_model_overhead,
    fsdp_unit_overhead,
    group_mesh,
    tp_linear_overhead,
    tp_model_overhead,
)
from diagnostics.telemetry import TelemetryWriter
from disttrain.config.errors import ConfigError
from disttrain.config.hardware import validate_profile
from disttrain.planner import Layout, Workload, comm_plan, model_shape, plan_layout
from disttrain.planner.calibrated import calibrated_profile
from disttrain.planner.comm import tp_parallel_linears_per_layer
from disttrain.planner.links import link_time
from disttrain.planner.memory import rank_parameters
from disttrain.planner.plan import DEFAULT_ASSUMPTIONS
from disttrain.planner.step_time import fsdp_host_seconds, tp_dispatch_seconds, tp_step_seconds
from tests.conftest import hw_profile as hw
from tests.conftest import model_preset as model

# A CPU box as a calibration describes it (no sync terms, so each test sees only the term it checks).
CPU = dataclasses.replace(
    hw("cpu"),
    peak_tflops={"fp32": 0.05},
    hbm_bandwidth_gbps=20.0,
    intra_node_bandwidth_gbps=1.0,
    intra_node_latency_us=200.0,
)
WORK = Workload(global_batch_size=32, micro_batch_size=16, seq_len=128, precision="fp32")


def test_tp_modules_per_layer_and_their_host_seconds() -> None:
    assert tp_parallel_linears_per_layer(swiglu=False) == 6  # q, k, v, o, w1, w2
    assert tp_parallel_linears_per_layer(swiglu=True) == 7  # and w3
    assert tp_dispatch_seconds(26, 800.0) == pytest.approx(26 * 0.8e-3)
    assert tp_dispatch_seconds(26, None) == 0.0  # not measured: not modelled (a GPU's host runs ahead)
    nano, llama = model_shape(model("gpt-nano")), model_shape(model("llama-7b"))
    # gpt-nano, tp=2: 4 blocks x 6 + the vocab-parallel embedding + the column-parallel head
    assert comm_plan(nano, Layout("megatron", tp=2), WORK, CPU).mb_tp_modules == 26
    # pp=2: the busiest stage has 2 blocks and one of the two edge modules; tp=1 has none
    assert (
        comm_plan(nano, Layout("megatron", tp=2, pp=2, microbatches=2, schedule="1f1b"), WORK, CPU).mb_tp_modules == 13
    )
    assert comm_plan(nano, Layout("megatron", dp=2), WORK, CPU).mb_tp_modules == 0
    assert comm_plan(nano, Layout("fsdp", dp=2), WORK, CPU).mb_tp_modules == 0
    assert comm_plan(llama, Layout("megatron", tp=8), WORK, hw("8xa100")).mb_tp_modules == 32 * 7 + 2


def test_measured_tp_edges_replace_the_two_edge_modules_on_the_stages_that_hold_them() -> None:
    assert tp_dispatch_seconds(26, 800.0, edges=1.0, edge_overhead_us=9000.0) == pytest.approx(24 * 0.8e-3 + 9e-3)
    assert tp_dispatch_seconds(13, 800.0, edges=0.5, edge_overhead_us=9000.0) == pytest.approx(12 * 0.8e-3 + 4.5e-3)
    assert tp_dispatch_seconds(26, 800.0, edges=1.0) == pytest.approx(26 * 0.8e-3)  # edges unmeasured: two modules
    nano = model_shape(model("gpt-nano"))
    assert comm_plan(nano, Layout("megatron", tp=2), WORK, CPU).mb_tp_edges == 1.0
    pp2 = Layout("megatron", tp=2, pp=2, microbatches=2, schedule="1f1b")
    assert comm_plan(nano, pp2, WORK, CPU).mb_tp_edges == 0.5  # the busiest stage holds one of the two edges
    assert comm_plan(nano, Layout("megatron", pp=2, microbatches=2), WORK, CPU).mb_tp_edges == 0.0
    measured = dataclasses.replace(CPU, tp_linear_overhead_us=800.0, tp_edge_overhead_us=9000.0)
    tp2 = Layout("megatron", tp=2, microbatches=2)
    assert plan_layout(nano, tp2, WORK, measured).estimate.host_dispatch_s == pytest.approx(2 * (24 * 0.8e-3 + 9e-3))


def test_the_measured_tp_overhead_lengthens_each_micro_batch_of_a_tp_layout_only() -> None:
    nano = model_shape(model("gpt-nano"))
    measured = dataclasses.replace(CPU, tp_linear_overhead_us=800.0)
    tp2 = Layout("megatron", tp=2, microbatches=2)  # global batch 32 = 2 micro-batches of 16 on the one dp rank
    before, after = plan_layout(nano, tp2, WORK, CPU).estimate, plan_layout(nano, tp2, WORK, measured).estimate
    assert before.host_dispatch_s == 0.0
    assert after.host_dispatch_s == pytest.approx(2 * 26 * 0.8e-3)
    assert after.step_time_s - before.step_time_s == pytest.approx(2 * 26 * 0.8e-3)
    ddp = Layout("ddp", dp=2)
    assert plan_layout(nano, ddp, WORK, measured).estimate == plan_layout(nano, ddp, WORK, CPU).estimate


def test_the_measured_tp_step_tail_lengthens_the_optimizer_step_per_block_on_the_rank() -> None:
    nano = model_shape(model("gpt-nano"))
    box = dataclasses.replace(CPU, devices_per_node=4)  # room for tp x pp on one node
    measured = dataclasses.replace(box, tp_step_overhead_us=3000.0)
    assert tp_step_seconds(4, 3000.0) == pytest.approx(12e-3) and tp_step_seconds(4, None) == 0.0
    for layout, blocks in (
        (Layout("megatron", tp=2, microbatches=2), 4),  # gpt-nano's 4 blocks
        (Layout("megatron", tp=2, pp=2, microbatches=2, schedule="1f1b"), 2),  # half of them per stage
    ):
        before = plan_layout(nano, layout, WORK, box).estimate
        after = plan_layout(nano, layout, WORK, measured).estimate
        assert after.optimizer_step_s - before.optimizer_step_s == pytest.approx(blocks * 3e-3)
        assert after.step_time_s - before.step_time_s == pytest.approx(blocks * 3e-3)
    for plain in (Layout("megatron", pp=2, microbatches=2), Layout("ddp", dp=2), Layout("fsdp", dp=2)):
        assert plan_layout(nano, plain, WORK, measured).estimate == plan_layout(nano, plain, WORK, box).estimate
    with pytest.raises(ConfigError, match=r"hw.tp_step_overhead_us: must be >= 0"):
        validate_profile(dataclasses.replace(CPU, tp_step_overhead_us=-1.0))


def test_fsdp_units_and_the_bytes_they_copy_per_micro_batch() -> None:
    nano = model_shape(model("gpt-nano"))
    fp32 = 4
    # strategy=fsdp over 2 ranks: a unit per block and the root; every micro-batch gathers all weights for forward,
    # the blocks' again for backward (resharded after forward), and fills the reduce-scatter buffers.
    fsdp = comm_plan(nano, Layout("fsdp", dp=2, microbatches=2), WORK, CPU)
    padded = 2 * nano.fsdp_shard_parameters(2)
    blocks = 2 * nano.n_layers * nano.fsdp_block_shard_parameters(2)
    assert fsdp.mb_fsdp_units == nano.n_layers + 1
    assert fsdp.mb_fsdp_copy_bytes == fp32 * (2 * padded + blocks)
    kept = comm_plan(nano, Layout("fsdp", dp=2, reshard_after_forward=False), WORK, CPU)
    assert kept.mb_fsdp_copy_bytes == fp32 * 2 * padded
    # strategy=megatron wraps its chunks in FSDP2 even over one data-parallel rank: tp=2, dp=1 still copies. Without
    # pipelining the weights gather every micro-batch (blocks twice), the gradients reduce once per step.
    tp2 = Layout("megatron", tp=2, microbatches=2)
    stage = rank_parameters(nano, tp2, 0)
    blocks = nano.n_layers * nano.block_tp_numel(2)
    plan = comm_plan(nano, tp2, WORK, CPU)
    assert plan.mb_fsdp_units == nano.n_layers + 1
    assert plan.mb_fsdp_copy_bytes == pytest.approx(fp32 * (stage + blocks) + fp32 * stage / 2)
    # Pipelined stages keep their gathered weights: one gather and one reduction per step, over its micro-batches.
    pp2 = Layout("megatron", pp=2, microbatches=2, schedule="1f1b")
    stage = max(rank_parameters(nano, pp2, 0), rank_parameters(nano, pp2, 1))
    plan = comm_plan(nano, pp2, WORK, CPU)
    assert plan.mb_fsdp_units == nano.n_layers // 2 + 1
    assert plan.mb_fsdp_copy_bytes == pytest.approx(2 * fp32 * stage / 2)
    v = comm_plan(nano, Layout("megatron", pp=2, virtual_stages=2, microbatches=2, schedule="zero_bubble"), WORK, CPU)
    assert v.mb_fsdp_units == nano.n_layers // 2 + 2  # two chunks per rank, each its own root
    for other in (Layout("ddp", dp=2), Layout("deepspeed", dp=2, zero_stage=2)):
        plan = comm_plan(nano, other, WORK, CPU)
        assert (plan.mb_fsdp_units, plan.mb_fsdp_copy_bytes) == (0.0, 0.0)


def test_the_measured_fsdp_costs_lengthen_each_micro_batch_of_fsdp_layouts_only() -> None:
    nano = model_shape(model("gpt-nano"))
    assert fsdp_host_seconds(5, 1e6, CPU) == 0.0  # not measured: not modelled
    measured = dataclasses.replace(CPU, fsdp_unit_overhead_us=1000.0, fsdp_copy_ns_per_byte=0.5)
    assert fsdp_host_seconds(5, 1e6, measured) == pytest.approx(5e-3 + 0.5e-3)
    for layout in (Layout("fsdp", dp=2, microbatches=2), Layout("megatron", tp=2, microbatches=2)):
        comm = comm_plan(nano, layout, WORK, CPU)
        before = plan_layout(nano, layout, WORK, CPU).estimate
        after = plan_layout(nano, layout, WORK, measured).estimate
        expected = 2 * (comm.mb_fsdp_units * 1e-3 + comm.mb_fsdp_copy_bytes * 0.5e-9)
        assert before.fsdp_host_s == 0.0 and after.fsdp_host_s == pytest.approx(expected) and expected > 0
        assert after.step_time_s - before.step_time_s == pytest.approx(expected)
    ddp = Layout("ddp", dp=2)
    assert plan_layout(nano, ddp, WORK, measured).estimate == plan_layout(nano, ddp, WORK, CPU).estimate
    with pytest.raises(ConfigError, match=r"hw.fsdp_copy_ns_per_byte: must be >= 0"):
        validate_profile(dataclasses.replace(CPU, fsdp_copy_ns_per_byte=-0.1))


@contextlib.contextmanager
def one_rank_group(store: Path) -> Iterator[None]:
    """A one-process gloo group with one torch thread, as every rank of a CPU run has: the probes then time the
    training thread's CPU clock."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def test_the_fsdp_probe_measures_hooks_and_copies_of_a_real_fully_shard_unit(tmp_path: Path) -> None:
    with one_rank_group(tmp_path / "store"):
        result = fsdp_unit_overhead(torch.device("cpu"), shard_ranks=1, repeats=4)
    assert result["ranks"] == 1
    assert result["unit_numel"] == {"16": 16 * 32 + 32 + 32 * 16 + 16, "512": 512 * 1024 + 1024 + 1024 * 512 + 512}
    # Even over one rank FSDP2 runs its hooks and copies through its buffers: both cost time on the host.
    assert result["fixed_us"] > 0 and result["ns_per_byte"] >= 0
    assert result["fixed_us"] == pytest.approx(result["overhead_s"]["16"] / 2 * 1e6)


def already(parts: dict) -> Callable[[object], dict]:
    """Parts built before the probe asks, whatever mesh it passes."""
    return lambda _mesh: parts


def test_the_fsdp_probe_on_the_runs_own_model_counts_its_copies_as_the_planner_does(tmp_path: Path) -> None:
    import functools

    from disttrain.config.strategy_schema import FSDPConfig
    from disttrain.strategies.fsdp_probe import fsdp_probe_parts

    tiny = dataclasses.replace(model("gpt-nano"), d_model=32, n_heads=2, ffn_hidden=64, vocab_size=64, seq_len=16)
    cpu = torch.device("cpu")
    for reshard, precision in ((True, "fp32"), (False, "fp32"), (True, "bf16-true")):
        fsdp = FSDPConfig(reshard_after_forward=reshard)
        parts = functools.partial(fsdp_probe_parts, tiny, fsdp, precision, device=cpu)
        with one_rank_group(tmp_path / f"store-{reshard}-{precision}"):
            built = parts(group_mesh(cpu, 1))
            # One block and the edges, plain and sharded: the same model, so the same logits.
            tokens = torch.randint(0, 64, (2, 16))
            assert torch.equal(built["plain"](tokens), built["sharded"](tokens))
            assert built["modules"] == 2 and len(built["sharded"].blocks) == 1  # the block's unit and the root
            # What it copies per forward + backward is what the planner counts for a run of that model on one rank
            # (bf16-true: parameters, gathers and gradients in 2 bytes).
            probe_shape = model_shape(dataclasses.replace(tiny, n_layers=1))
            work = dataclasses.replace(WORK, precision=precision)
            planned = comm_plan(probe_shape, Layout("fsdp", dp=1, reshard_after_forward=reshard), work, CPU)
            assert built["copy_bytes"] == planned.mb_fsdp_copy_bytes > 0
            result = fsdp_model_overhead(cpu, 1, already(built), micro_batch=2, fixed_us=100.0, repeats=2)
        assert (result["probe"], result["tokens"], result["modules"]) == ("model", 32, 2)
        assert result["sharded_model_s"] > 0 and result["plain_model_s"] > 0 and result["sharded_blocked_s"] >= 0
        # Less the hooks of its two FSDP2 modules, the rest is charged per byte copied.
        net = result["model_extra_s"] - 2 * 100e-6
        assert result["ns_per_byte"] == pytest.approx(max(0.0, net) / result["copy_bytes"] * 1e9)
    # An HF model's probe is its own config at two layers, its copies counted as the planner counts its shape's.
    from disttrain.config.hf import hf_shape
    from disttrain.config.schema import HFModelConfig
    from tests.hf_fixtures import TINY_LLAMA

    llama = HFModelConfig(config=dict(TINY_LLAMA), seq_len=16)
    with one_rank_group(tmp_path / "store-hf"):
        built = fsdp_probe_parts(llama, FSDPConfig(), "fp32", group_mesh(cpu, 1), device=cpu)
    two_layers = model_shape(dataclasses.replace(hf_shape(llama), n_layers=2))
    assert built["modules"] == 3 and built["vocab_size"] == TINY_LLAMA["vocab_size"]
    assert built["copy_bytes"] == comm_plan(two_layers, Layout("fsdp", dp=1), WORK, CPU).mb_fsdp_copy_bytes


def test_the_fsdp_probe_builds_the_runs_model_only_where_its_twin_runs_the_same_math() -> None:
    from disttrain.config.schema import CustomModelConfig, HFModelConfig, PrecisionConfig
    from disttrain.config.strategy_schema import FSDPConfig
    from disttrain.strategies.fsdp_probe import fsdp_probe_supported
    from tests.hf_fixtures import TINY_LLAMA

    nano, fsdp, fp32 = model("gpt-nano"), FSDPConfig(), PrecisionConfig(name="fp32")
    assert fsdp_probe_supported(nano, fsdp, fp32, compiled=False)
    assert fsdp_probe_supported(nano, fsdp, PrecisionConfig(name="bf16-true"), compiled=False)
    llama = HFModelConfig(config=dict(TINY_LLAMA), seq_len=32)
    assert fsdp_probe_supported(llama, fsdp, fp32, compiled=False)
    refused = [
        (nano, fsdp, PrecisionConfig(name="bf16-mixed"), False),  # FSDP2 casts: the plain twin would not
        (nano, fsdp, fp32, True),  # compiled blocks
        (model("moe-micro"), fsdp, fp32, False),  # experts
        (nano, FSDPConfig(activation_checkpointing=True), fp32, False),
        (nano, FSDPConfig(cpu_offload=True), fp32, False),
        (CustomModelConfig(target="my.Model", vocab_size=64, seq_len=16), fsdp, fp32, False),  # layers unknown
    ]
    for args in refused:
        assert not fsdp_probe_supported(*args), args


def test_the_tp_probe_times_a_real_dtensor_pair_at_the_runs_shapes_net_of_its_collectives(tmp_path: Path) -> None:
    with one_rank_group(tmp_path / "store"):
        result = tp_linear_overhead(torch.device("cpu"), tp=1, tokens=64, width=32, repeats=3)
    assert (result["ranks"], result["tokens"], result["width"]) == (1, 64, 32)
    assert result["collective_s"] > 0  # a functional all-reduce costs the host even over one rank
    # DTensor dispatch makes the parallel pair dearer than the plain one; what the probe charges per linear is
    # that difference (the median of paired rounds) less the two collectives the planner prices on their own
    assert result["parallel_pair_s"] > result["plain_pair_s"] and result["pair_extra_s"] > 0
    net = result["pair_extra_s"] - 2 * result["collective_s"]
    assert result["overhead_us"] == pytest.approx(max(0.0, net) / 2 * 1e6)


def test_the_tp_probe_on_the_runs_own_block_and_edges(tmp_path: Path) -> None:
    import functools

    from disttrain.models.tensor_parallel import tp_probe_parts

    tiny = dataclasses.replace(model("gpt-nano"), d_model=32, n_heads=2, ffn_hidden=64, vocab_size=64, seq_len=16)
    parts = functools.partial(tp_probe_parts, tiny, loss_parallel=True, device=torch.device("cpu"))
    with one_rank_group(tmp_path / "store"):
        result = tp_model_overhead(torch.device("cpu"), 1, parts, micro_batch=2, repeats=2)
    assert (result["probe"], result["ranks"], result["tokens"], result["width"]) == ("model", 1, 32, 32)
    assert result["modules_per_block"] == 6  # q, k, v, o, w1, w2
    # DTensor makes both parts dearer than their plain twins; the charged overhead is that, net of the collectives
    assert result["block_extra_s"] > 0 and result["edges_extra_s"] > 0
    block = result["block_extra_s"] - 6 * result["collective_s"]
    edges = result["edges_extra_s"] - 2 * result["collective_s"]
    assert result["overhead_us"] == pytest.approx(max(0.0, block) / 6 * 1e6)
    assert result["edge_overhead_us"] == pytest.approx(max(0.0, edges) * 1e6)
    # The time the parallel parts sat blocked in their collectives is recorded beside them (not priced: see
    # docs/planner.md), with what it is spread over and the clock it was told apart on
    assert result["parallel_block_blocked_s"] >= 0.0 and result["parallel_edges_blocked_s"] >= 0.0
    assert result["collectives_per_block"] == 6 and result["clock"] in ("thread_cpu", "process_cpu")
    assert "step_overhead_us" not in result  # no optimizer given: the step's tail is not timed


def _burn(seconds: float) -> Callable[..., None]:
    """A forward hook that spends ``seconds`` of this thread's CPU time (what the probe's compute clock counts)."""

    def hook(*_: object) -> None:
        start = time.thread_time()
        while time.thread_time() - start < seconds:
            pass

    return hook


def test_the_tp_probe_of_an_hf_model_times_its_own_layers_inside_its_passes(tmp_path: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from disttrain.config.schema import HFModelConfig, OptimizerConfig
    from disttrain.models.hf_tensor_parallel import hf_tp_probe_parts
    from disttrain.training.step_tail import with_step_tail

    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 2}
    config = {"model_type": "llama", **shape, "num_key_value_heads": 1, "vocab_size": 64, "max_position_embeddings": 64}
    model = HFModelConfig(config=config, seq_len=16)
    cpu = torch.device("cpu")
    with one_rank_group(tmp_path / "store"):
        mesh = init_device_mesh("cpu", (1,))
        build = with_step_tail(hf_tp_probe_parts, OptimizerConfig())
        built = build(model, mesh, loss_parallel=True, device=cpu)
        parallel = built["model"][1]
        assert built["modules_per_block"] == built["collectives_per_block"] == 7  # q, k, v, o, gate, up, down
        assert len(built["layers"][1]) == 2 and (built["d_model"], built["vocab_size"]) == (32, 64)

        def probe(hooked: list[torch.nn.Module], hook: Callable[..., None]) -> dict:
            handles = [module.register_forward_hook(hook) for module in hooked]
            try:
                return tp_model_overhead(cpu, 1, lambda _mesh: built, micro_batch=2, repeats=2)
            finally:
                for handle in handles:
                    handle.remove()

        plain = probe([], _burn(0.0))
        layers = [layer.mlp for layer in built["layers"][1]]
        in_layers = probe(layers, _burn(0.02))  # CPU work inside each parallel layer: block time
        in_norm = probe([parallel.hf.model.norm], _burn(0.02))  # in the final norm: edge time
        asleep = probe(layers, lambda *_: time.sleep(0.02))  # blocked inside each layer: neither, but blocked
    assert plain["probe"] == "model" and plain["modules_per_block"] == 7
    # the step's tail over the first layer: DTensors dispatch every op per tensor, so the parallel one costs more
    assert plain["parallel_step_tail_s"] > plain["plain_step_tail_s"] > 0
    tail_extra = plain["parallel_step_tail_s"] - plain["plain_step_tail_s"]
    assert plain["step_overhead_us"] == pytest.approx(tail_extra * 1e6)
    # The extras are differences of two timed passes: 20 ms burnt can read a hair under (19.94 ms in one CI run).
    burnt = 0.9 * 0.02
    assert in_layers["block_extra_s"] >= burnt > in_layers["edges_extra_s"]
    assert in_norm["edges_extra_s"] >= burnt > in_norm["block_extra_s"]
    assert asleep["parallel_block_blocked_s"] >= burnt > asleep["block_extra_s"]


def test_a_measured_overlap_replaces_the_assumed_one_for_hidden_collectives() -> None:
    nano = model_shape(model("gpt-nano"))
    fsdp = Layout("fsdp", dp=2)
    comm = comm_plan(nano, fsdp, WORK, CPU)
    assert comm.mb_exposed.network == 0 and comm.mb_fwd.network > 0 and comm.mb_bwd.network > 0
    est = plan_layout(nano, fsdp, WORK, CPU).estimate
    fwd, bwd = link_time(comm.mb_fwd, CPU, 25.0), link_time(comm.mb_bwd, CPU, 25.0)
    # one micro-batch: a third of its FLOPs in forward (2N of 6N), the rest in backward
    forward = est.compute_s / 3
    backward = est.compute_s - forward
    assumed = max(0.0, fwd - 0.8 * forward) + max(0.0, bwd - 0.8 * backward)
    assert est.exposed_comm_s == pytest.approx(assumed)
    none_hidden = plan_layout(nano, fsdp, WORK, dataclasses.replace(CPU, comm_overlap=0.0)).estimate
    assert none_hidden.exposed_comm_s == pytest.approx(fwd + bwd)  # gloo's threads share the compute's cores
    assert none_hidden.step_time_s - est.step_time_s == pytest.approx(fwd + bwd - assumed)
    half = plan_layout(nano, fsdp, WORK, dataclasses.replace(CPU, comm_overlap=0.5)).estimate
    assert half.exposed_comm_s == pytest.approx(max(0.0, fwd - 0.5 * forward) + max(0.0, bwd - 0.5 * backward))
    # DDP's one gradient all-reduce is hidden behind backward too: measured 0, it is all exposed
    ddp = Layout("ddp", dp=2)
    all_reduce = link_time(comm_plan(nano, ddp, WORK, CPU).step_bwd, CPU, 25.0)
    exposed = plan_layout(nano, ddp, WORK, dataclasses.replace(CPU, comm_overlap=0.0)).estimate.exposed_comm_s
    assert exposed == pytest.approx(all_reduce) and all_reduce > 0
    with pytest.raises(ConfigError, match=r"hw.comm_overlap: must be in \[0, 1\], got 1.5"):
        validate_profile(dataclasses.replace(CPU, comm_overlap=1.5))
    with pytest.raises(ConfigError, match=r"hw.tp_linear_overhead_us: must be >= 0"):
        validate_profile(dataclasses.replace(CPU, tp_linear_overhead_us=-1.0))
    assert DEFAULT_ASSUMPTIONS.comm_overlap == 0.8


def test_overlap_and_tp_overhead_are_read_back_and_substituted(tmp_path: Path) -> None:
    for rank, (hidden, overhead) in enumerate([(0.0, 700.0), (0.1, 900.0)]):
        w = TelemetryWriter(tmp_path, rank)
        w.write("calibration", when="start", dtype="fp32", matrix_size=512, flops_per_s=9e10, seconds=0.15)
        w.write("overlap_calibration", ranks=2, bytes=8 << 20, compute_s=0.01, comm_s=0.01, both_s=0.02, hidden=hidden)
        w.write(
            "tp_calibration", probe="model", ranks=2, overhead_us=overhead, edge_overhead_us=10 * overhead,
            step_overhead_us=3 * overhead,
        )  # fmt: skip
        w.write("fsdp_calibration", ranks=2, fixed_us=overhead, ns_per_byte=hidden + 0.3)
        w.write("overlap_calibration", ranks=2, hidden=1.7)  # out of range: ignored
        w.close()
    cal = calibration_from_telemetry(tmp_path)
    assert cal.comm_overlap == pytest.approx(0.05) and cal.tp_linear_overhead_us == pytest.approx(800.0)
    profile = calibrated_profile(hw("cpu"), cal, "fp32")
    assert (profile.hw.comm_overlap, profile.hw.tp_linear_overhead_us) == (pytest.approx(0.05), pytest.approx(800.0))
    assert profile.sources["comm_overlap"] == profile.sources["tp_linear_overhead_us"] == "measured"
    assert (cal.fsdp_unit_overhead_us, cal.fsdp_copy_ns_per_byte) == (pytest.approx(800.0), pytest.approx(0.35))
    assert cal.tp_edge_overhead_us == pytest.approx(8000.0)
    assert cal.tp_step_overhead_us == pytest.approx(2400.0)
    assert calibrated_profile(hw("cpu"), cal, "fp32").hw.tp_step_overhead_us == pytest.approx(2400.0)
    assert profile.hw.fsdp_copy_ns_per_byte == pytest.approx(0.35)
    assert profile.sources["fsdp_unit_overhead_us"] == profile.sources["fsdp_copy_ns_per_byte"] == "measured"
    bare = calibrated_profile(hw("cpu"), None, "fp32")
    assert bare.sources["comm_overlap"] == bare.sources["tp_linear_overhead_us"] == "none"


def test_the_cpu_matmul_clock_does_not_count_time_the_process_is_not_running() -> None:
    name, clock = compute_clock(torch.device("cpu"))
    assert name in ("thread_cpu", "process_cpu")
    start = clock()
    time.sleep(0.2)  # descheduled (as under another process's load): no compute time passes
    assert clock() - start < 0.05
    start = clock()
    deadline = time.perf_counter() + 10.0
    while clock() - start < 0.02 and time.perf_counter() < deadline:  # busy: CPU time passes, however loaded
        pass
    assert clock() - start >= 0.02


def test_time_another_process_holds_the_core_is_told_apart_from_blocking() -> None:
    import os
    import subprocess
    import sys
    import threading

    if runqueue_seconds() == 0.0:
        pytest.skip("the kernel reports no schedstat here")
    core = {min(os.sched_getaffinity(0))}
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(hog.pid, core)
    results: dict[str, float] = {}

    def busy_then_blocked() -> None:
        os.sched_setaffinity(0, core)
        wall, cpu, queued = time.perf_counter(), time.thread_time(), runqueue_seconds()
        while time.thread_time() - cpu < 0.2:  # 0.2 s of our own compute on a core the hog wants too
            pass
        time.sleep(0.1)  # blocked (as in a collective): neither compute nor preemption
        results.update(wall=time.perf_counter() - wall, cpu=time.thread_time() - cpu)
        results["queued"] = runqueue_seconds() - queued

    try:  # in a thread of its own, pinned beside the hog: the test process's other threads keep their cores
        mine = threading.Thread(target=busy_then_blocked)
        mine.start()
        mine.join(timeout=30)
    finally:
        hog.kill()
        hog.wait()
    # wall = compute + preempted + blocked: what is left after the two clocks is the sleep, however long the hog held
    # the core
    assert results["queued"] > 0.05
    assert results["wall"] - results["cpu"] - results["queued"] == pytest.approx(0.1, abs=0.03)


def test_a_collectives_latency_is_read_off_a_tensor_sized_call_not_one_element(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from diagnostics.collect import calibrate_comm as calibrate

    # gloo's all-reduce on 2 CPU ranks as measured: 8 MiB in 8.6 ms, 256 KiB in 3.1 ms, one element in 0.27 ms
    timings = {8 << 20: 8.6e-3, 256 << 10: 3.1e-3}

    calls: dict[int, int] = {}

    def median_call(op: str, group: object, numel: int, n: int, device: torch.device, repeats: int) -> tuple:
        calls[numel * 4] = repeats
        return timings[numel * 4], numel * 4

    monkeypatch.setattr(calibrate, "_median_call", median_call)
    monkeypatch.setattr(calibrate, "_fastest_call", lambda op, group, n, device: 0.27e-3)
    monkeypatch.setattr("torch.distributed.get_world_size", lambda group=None: 2)
    record = calibrate.collective_bandwidth("all_reduce", None, 8 << 20, torch.device("cpu"))
    busbw = (8 << 20) / 8.6e-3 / 1e9 * 1.0  # 2 (n - 1) / n = 1 over 2 ranks
    assert record["busbw_gbps"] == pytest.approx(busbw)
    assert record["latency_bytes"] == 256 << 10 and record["call_latency_us"] == pytest.approx(270.0)
    # what the 256 KiB call cost beyond its bytes at the 8 MiB call's bandwidth: 2.83 ms, not the one element's 0.27
    assert record["latency_us"] == pytest.approx((3.1e-3 - (256 << 10) / (busbw * 1e9)) * 1e6)
    assert record["latency_us"] == pytest.approx(2831, rel=0.01)
    # the latency's median over enough calls that one moment of a shared host does not make it (the bandwidth's 3)
    assert calls == {8 << 20: 3, 256 << 10: calibrate.LATENCY_CALLS} and calibrate.LATENCY_CALLS >= 15
    # never below the one-element call (a size past the algorithm's switch can look free)
    timings[256 << 10] = 0.1e-3
    assert calibrate.collective_bandwidth("all_reduce", None, 8 << 20, torch.device("cpu"))["latency_us"] == 270.0


def test_a_cpu_host_hides_collectives_only_with_a_spare_core_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from diagnostics.collect import calibrate_comm as calibrate

    cpu = torch.device("cpu")
    monkeypatch.setattr(calibrate.os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
    monkeypatch.setattr(calibrate.torch, "get_num_threads", lambda: 1)
    this_box = calibrate.comm_overlap(None, 8 << 20, cpu, local_ranks=2)  # a rank per core: gloo takes compute's
    assert (this_box["method"], this_box["hidden"]) == ("spare_cores", 0.0)
    assert calibrate.comm_overlap(None, 8 << 20, cpu, local_ranks=1)["hidden"] == 1.0  # a whole core spare
    monkeypatch.setattr(calibrate.os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    assert calibrate.comm_overlap(None, 8 << 20, cpu, local_ranks=4)["hidden"] == pytest.approx(0.5)  # 1.5 - 1
    monkeypatch.setattr(calibrate.torch, "get_num_threads", lambda: 3)
    assert calibrate.comm_overlap(None, 8 << 20, cpu, local_ranks=2)["hidden"] == 0.0  # 3 cores, 3 threads each


def test_the_callback_times_fsdp2_on_the_runs_model_and_falls_back_to_the_pair_where_it_cannot(tmp_path: Path) -> None:
    """The start-up calibration of a strategy=fsdp run: the run's own model when the pipeline could give one; a model
    whose copy fails (alike on every rank, before any collective) leaves an error record and the Linear pair's
    per-byte figure, and the run goes on."""
    import functools
    import json
    from types import SimpleNamespace

    from diagnostics.collect.callback import DiagnosticsCallback
    from diagnostics.collect.run_facts import CollectSettings, RunFacts
    from diagnostics.telemetry import TelemetryWriter, telemetry_path
    from disttrain.config.strategy_schema import FSDPConfig
    from disttrain.strategies.fsdp_probe import fsdp_probe_parts

    tiny = dataclasses.replace(model("gpt-nano"), d_model=32, n_heads=2, ffn_hidden=64, vocab_size=64, seq_len=16)

    def unbuildable(mesh: object, device: torch.device) -> dict:
        raise RuntimeError("this model cannot be copied")

    probes = {"own": functools.partial(fsdp_probe_parts, tiny, FSDPConfig(), "fp32"), "failing": unbuildable}
    trainer = SimpleNamespace(global_rank=0, world_size=2, num_nodes=1, num_devices=2)  # calibrate_links' fields
    for name, probe in probes.items():
        facts = RunFacts(
            *("fsdp", "fp32", "fp32", "cpu", 10, 60.0, 60.0, 32, 2, 1, 16, 10, None),
            fsdp_shard_ranks=1,
            fsdp_probe=probe,
        )
        run_dir = tmp_path / name
        callback = DiagnosticsCallback(CollectSettings(), facts, run_dir, lambda: None)
        callback.writer = TelemetryWriter(run_dir, 0)
        with one_rank_group(tmp_path / f"store-{name}"):
            callback.calibrate_links(trainer, torch.device("cpu"))  # type: ignore[arg-type]
        callback.writer.close()
        records = [json.loads(line) for line in telemetry_path(run_dir, 0).read_text().splitlines()]
        (fsdp,) = [r for r in records if r["kind"] == "fsdp_calibration"]
        errors = [r for r in records if r["kind"] == "error"]
        assert fsdp["ns_per_byte"] >= 0 and fsdp["fixed_us"] > 0
        if name == "own":
            assert fsdp["probe"] == "model" and set(fsdp["overhead_s"]) == {"16"} and errors == []
        else:
            assert "probe" not in fsdp and set(fsdp["overhead_s"]) == {"16", "512"}
            assert [(r["source"], r["message"]) for r in errors] == [
                ("fsdp_model_calibration", "RuntimeError: this model cannot be copied")
            ]
