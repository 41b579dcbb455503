"""The planner at launch: memory prediction of the run's own layout, the fit check, strategy=auto."""

from __future__ import annotations

import dataclasses

import pytest

import disttrain.strategies.auto as auto
from diagnostics.calibration import Calibration
from diagnostics.prediction import one_line
from disttrain.config.errors import ConfigError
from disttrain.config.hf import reference_shape
from disttrain.config.parse import parse_run_config
from disttrain.config.strategy_schema import DDPConfig, DeepSpeedConfig, FSDPConfig, MegatronConfig
from disttrain.job.prediction import predict_run, with_measurement
from disttrain.planner import model_shape, plan_layout
from disttrain.strategies.auto import (
    AUTO_TIE,
    auto_candidates,
    check_fits,
    describe_memory,
    layout_of,
    predict_memory,
    resolve_auto,
    workload,
)
from disttrain.strategies.layout import parallel_layout, validate_run, world_layout
from tests.conftest import compose_train

LLAMA7B_8XA100 = ["model=llama-7b", "hw=8xa100", "trainer.micro_batch_size=1", "precision=bf16-mixed"]


def resolved(overrides: list[str]):
    cfg = parse_run_config(compose_train(overrides))
    return resolve_auto(cfg, parallel_layout(cfg))


def test_auto_on_cpu_is_ddp_and_says_why() -> None:
    cfg, why = resolved(["strategy=auto"])
    assert cfg.strategy == DDPConfig(gradient_as_bucket_view=False)  # decided for the CPU
    assert "hw=cpu" in why


def test_auto_for_llama7b_on_8xa100_shards_because_ddp_cannot_fit() -> None:
    cfg, why = resolved(["strategy=auto", *LLAMA7B_8XA100])
    assert isinstance(cfg.strategy, FSDPConfig)
    assert "FSDP2" in why and "fit" in why
    ddp = parse_run_config(compose_train(["strategy=ddp", *LLAMA7B_8XA100]))
    ddp_memory = predict_memory(ddp, parallel_layout(ddp))
    with pytest.raises(ConfigError, match="exceeds") as info:
        check_fits(ddp, ddp_memory, check_memory=True)
    assert info.value.key == "strategy" and "check_memory=false" in info.value.fix
    check_fits(ddp, ddp_memory, check_memory=False)  # the user's override launches anyway
    chosen_memory = predict_memory(cfg, parallel_layout(cfg))
    assert chosen_memory is not None and chosen_memory.total < ddp_memory.total
    check_fits(cfg, chosen_memory, check_memory=True)


def test_auto_refuses_when_nothing_fits() -> None:
    # Micro-batch 64 x 4096 tokens: activations alone overflow an L4 (ZeRO-3 offload holds no model states there).
    with pytest.raises(ConfigError, match=r"no ddp/fsdp/deepspeed/megatron layout fits.*the smallest") as info:
        resolved(["strategy=auto", "model=llama-70b", "hw=1xl4", "trainer.micro_batch_size=64"])
    assert "python -m plan" in info.value.fix


def test_prediction_follows_the_strategy_options() -> None:
    def total(extra: list[str]) -> int:
        cfg = parse_run_config(compose_train(["strategy=fsdp", *LLAMA7B_8XA100, *extra]))
        memory = predict_memory(cfg, parallel_layout(cfg))
        assert memory is not None
        return memory.total

    assert total(["strategy.activation_checkpointing=true"]) < total([])
    assert total([]) < total(["strategy.reshard_after_forward=false"])


def test_no_prediction_for_a_user_model() -> None:
    cfg = parse_run_config(compose_train(["~model", "+model._target_=tests.plugins.BigramModel",
                                          "+model.vocab_size=16", "+model.seq_len=16"]))  # fmt: skip
    assert predict_memory(cfg, parallel_layout(cfg)) is None


def test_auto_chooses_tensor_parallelism_when_only_it_fits() -> None:
    """llama-7b at micro 32 x 4096 tokens: no data-parallel layout fits an A100 (activations), TP with SP does."""
    cfg, why = resolved(["strategy=auto", *LLAMA7B_8XA100, "trainer.micro_batch_size=32"])
    assert cfg.strategy.name == "megatron" and cfg.strategy.tp > 1 and cfg.strategy.sequence_parallel
    assert "megatron layouts that fit" in why
    # The choice is a runnable config: it validates and its prediction fits.
    memory = predict_memory(cfg, parallel_layout(cfg))
    assert memory is not None and memory.total <= 0.9 * 80 * 2**30


def test_auto_considers_hybrid_sharding_only_across_nodes() -> None:
    def replicas(hw: str) -> set[int]:
        cfg = parse_run_config(compose_train(["strategy=auto", "model=llama-7b", f"hw={hw}"]))
        return {c.dp_replicate for c in auto_candidates(cfg) if isinstance(c, FSDPConfig)}

    assert replicas("8xa100") == {1}
    assert replicas("2x8xh100") == {1, 2}  # one replica group per node


def test_megatron_rounds_hold_one_schedule_run_of_activations() -> None:
    """A global batch of 4 schedule runs (rounds) holds the activations of one run at a time: GPipe's peak is the
    run's 2 micro-batches, not the step's 8, and each run has the 2-micro-batch bubble."""
    from disttrain.strategies.auto import layout_of

    base = ["strategy=megatron", "strategy.pp=2", "strategy.schedule=gpipe", "strategy.microbatches=2"]
    base += ["model=llama-7b", "hw=8xa100", "trainer.micro_batch_size=1", "precision=bf16-mixed"]

    def activations(extra: list[str]) -> tuple[int, int]:
        cfg = parse_run_config(compose_train([*base, *extra]))
        parallel = parallel_layout(cfg)
        memory = predict_memory(cfg, parallel)
        assert memory is not None
        return memory.activations, parallel.batch.accumulation

    one_run, accumulation = activations([])
    four_runs, accumulation_of_four = activations(["trainer.global_batch_size=32"])  # 1 x dp 4 x 2 x 4 rounds
    assert (accumulation, accumulation_of_four) == (2, 8)
    assert four_runs == one_run
    cfg = parse_run_config(compose_train([*base, "trainer.global_batch_size=32"]))
    layout = layout_of(cfg.strategy, world_layout(cfg), validate_run(cfg))
    assert (layout.microbatches, layout.per_schedule) == (8, 2)


def test_megatron_prediction_follows_the_data_parallel_type() -> None:
    """dp_type=replicate keeps whole fp32 states on every data-parallel rank, hsdp shards within each replica."""
    base = ["strategy=megatron", "strategy.tp=2", "model=llama-7b", "hw=8xa100", "trainer.micro_batch_size=1"]

    def states(extra: list[str]) -> int:
        cfg = parse_run_config(compose_train([*base, "precision=bf16-mixed", *extra]))
        memory = predict_memory(cfg, parallel_layout(cfg))
        assert memory is not None
        return memory.params + memory.grads + memory.optimizer_states

    fsdp, hsdp = states([]), states(["strategy.dp_type=hsdp", "strategy.dp_replicate=2"])
    replicate = states(["strategy.dp_type=replicate"])
    assert replicate == pytest.approx(4 * fsdp, rel=1e-3) and hsdp == pytest.approx(2 * fsdp, rel=1e-3)


def cpu_calibration(link_gbps: float) -> Calibration:
    return Calibration(
        matmul_flops_per_s={"fp32": 5.0e10},
        memory_bandwidth_gbps=10.0,
        links={"intra_node": {"all_reduce": link_gbps}},
        source="RUN",
    )


def test_auto_on_cpu_with_a_calibration_ranks_layouts_by_measured_speeds() -> None:
    # One global batch for every layout (Megatron tp2 on 2 processes has dp=1: half DDP's default batch).
    cfg = parse_run_config(compose_train(["strategy=auto", "trainer.global_batch_size=32"]))
    for link_gbps in (100.0, 1e-3):
        calibration = cpu_calibration(link_gbps)
        chosen, why = resolve_auto(cfg, parallel_layout(cfg), calibration)
        assert "strategy=auto chose" in why and "measured speeds of RUN" in why
        step = predict_run(chosen, parallel_layout(chosen), calibration)["predicted"]["step_time_s"]
        for other in (DDPConfig(), FSDPConfig(), DeepSpeedConfig(stage=3), MegatronConfig(tp=2)):
            alternative = dataclasses.replace(cfg, strategy=other)
            predicted = predict_run(alternative, parallel_layout(alternative), calibration)["predicted"]
            assert step <= predicted["step_time_s"] * (1 + AUTO_TIE), (link_gbps, other)


def test_run_prediction_says_which_numbers_it_used_and_why_it_could_not_time_the_step() -> None:
    cfg = parse_run_config(compose_train([]))
    without = predict_run(cfg, parallel_layout(cfg), None)
    assert without is not None and "step_time_s" not in without["predicted"]
    assert "peak_tflops" in without["unpredicted"] and "diagnostics.calibrate=true" in without["unpredicted"]
    assert one_line(without).startswith("planner: step time not predicted: hw profile 'cpu' has no peak_tflops")
    assert without["predicted"]["state_bytes"] == 16 * 1_828_992  # fp32 weights, gradients, two Adam moments
    compute = ("block_forward_backward", "edges_forward_backward", "optimizer_step", "activations")
    assert {v for k, v in without["basis"].items() if k not in compute} == {"none"}
    # No parts measured: the compute is FLOPs over a matmul rate, the optimizer step Adam's bytes over bandwidth,
    # the activations the formula's.
    assert [without["basis"][k] for k in compute] == ["flops", "flops", "memory_bandwidth", "formula"]
    calibrated = predict_run(cfg, parallel_layout(cfg), cpu_calibration(5.0))
    assert calibrated is not None and calibrated["basis"]["peak_tflops"] == "measured"
    p = calibrated["predicted"]
    assert p["peak_flops"] == 5.0e10 and p["step_time_s"] > p["compute_s"] > 0 and p["comm_s"] > 0
    assert p["tokens_per_s"] == pytest.approx(32 * 128 / p["step_time_s"])
    measured = with_measurement(calibrated, {"step_time_s": p["step_time_s"] * 2})
    assert measured["error"] == {"step_time_s": pytest.approx(-0.5)}
    assert "datasheet" not in measured  # hw=cpu has none to compare with


def test_a_calibrated_gpu_run_also_says_how_far_off_its_datasheet_alone_was() -> None:
    cfg = parse_run_config(compose_train(["strategy=fsdp", *LLAMA7B_8XA100]))
    world, plan = world_layout(cfg), validate_run(cfg)
    # This GPU's matmuls measured at 60% of the 312 TFLOPS datasheet peak, NVLink at half its 300 GB/s.
    calibration = Calibration(
        matmul_flops_per_s={"bf16": 0.6 * 312e12}, links={"intra_node": {"all_gather": 150.0}}, source="RUN"
    )
    record = predict_run(cfg, parallel_layout(cfg), calibration)
    sheet = plan_layout(
        model_shape(reference_shape(cfg.model)), layout_of(cfg.strategy, world, plan), workload(cfg, plan), cfg.hw
    )
    assert record["datasheet"] == {
        "step_time_s": pytest.approx(sheet.step_time_s),
        "tokens_per_s": pytest.approx(sheet.tokens_per_s),
    }
    assert record["predicted"]["step_time_s"] > sheet.step_time_s  # the measured speeds are slower
    measured = with_measurement(record, {"step_time_s": record["predicted"]["step_time_s"]})
    assert measured["error"]["step_time_s"] == pytest.approx(0.0)
    assert measured["datasheet_error"]["step_time_s"] == pytest.approx(
        sheet.step_time_s / record["predicted"]["step_time_s"] - 1
    )
    line = one_line(measured)
    assert "planner (calibrated) predicted vs measured: step time" in line
    assert f"; datasheet alone: step time {sheet.step_time_s * 1e3:.1f} ms (" in line


def test_offloaded_states_are_checked_against_the_hosts_memory() -> None:
    """ZeRO-3 offload of llama-70b puts ~145 GiB per GPU on the host: 8 GPUs fit a DGX's 2 TiB, not 512 GiB."""
    offload = [
        "strategy=deepspeed",
        "strategy.stage=3",
        "strategy.offload_optimizer=true",
        "strategy.offload_params=true",
        "model=llama-70b",
        "model.seq_len=2048",
        "hw=8xa100",
        "trainer.micro_batch_size=1",
        "precision=bf16-mixed",
    ]
    cfg = parse_run_config(compose_train(offload))
    memory = predict_memory(cfg, parallel_layout(cfg))
    assert memory is not None and 140 * 2**30 < memory.host < 150 * 2**30
    check_fits(cfg, memory, check_memory=True)  # 8 x 145 GiB within 0.9 x 2048 GiB
    usable = 0.9 * 2048 / 8
    assert (
        f"host (offloaded) {memory.host / 2**30:.2f} GiB per GPU, fits in {usable:.1f} GiB usable"
        in describe_memory(cfg, memory)
    )
    small = parse_run_config(compose_train([*offload, "hw.host_memory_gib=512"]))
    with pytest.raises(ConfigError, match=r"offloaded states per device .* exceeds the 460.8 GiB of host") as info:
        check_fits(small, memory, check_memory=True)
    assert info.value.key == "hw.host_memory_gib" and "offload_params=false" in info.value.fix
    assert "EXCEEDS 57.6 GiB usable" in describe_memory(small, memory)
    check_fits(small, memory, check_memory=False)
    layout = layout_of(small.strategy, world_layout(small), validate_run(small))
    planned = plan_layout(
        model_shape(reference_shape(small.model)), layout, workload(small, validate_run(small)), small.hw
    )
    assert not planned.fits and any("hw.host_memory_gib" in note for note in planned.notes)


def test_auto_names_the_layouts_it_could_not_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout whose link has no bandwidth is left out of the ranking, and the choice says so (not silently)."""
    real = auto.plan_layout

    def no_deepspeed_link(shape, layout, *args, **kwargs):  # type: ignore[no-untyped-def]
        if layout.strategy == "deepspeed":
            raise ValueError("hw=8xa100 gives no bandwidth for the link deepspeed needs")
        return real(shape, layout, *args, **kwargs)

    _, complete = resolved(["strategy=auto", *LLAMA7B_8XA100])
    assert "could not be timed" not in complete
    monkeypatch.setattr(auto, "plan_layout", no_deepspeed_link)
    cfg, why = resolved(["strategy=auto", *LLAMA7B_8XA100])
    assert not isinstance(cfg.strategy, DeepSpeedConfig)
    assert "more could not be timed (hw=8xa100 gives no bandwidth for the link deepspeed needs)" in why
