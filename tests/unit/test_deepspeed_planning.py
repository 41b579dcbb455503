"""DeepSpeed in the launch-time planner (memory prediction, strategy=auto), the recommendations, and the optimizer
swap used under offload: pure functions, no process group."""

from __future__ import annotations

import pytest
import torch

from diagnostics.analysis import Finding
from diagnostics.analysis.context import RunContext
from diagnostics.recommend import recommend
from disttrain.config.parse import parse_run_config
from disttrain.config.strategy_schema import DDPConfig, DeepSpeedConfig, FSDPConfig
from disttrain.strategies.auto import auto_candidates, layout_of, predict_memory, resolve_auto
from disttrain.strategies.layout import batch_plan, parallel_layout, validate_run, world_layout
from tests.conftest import compose_train

LLAMA7B_8XA100 = ["model=llama-7b", "hw=8xa100", "trainer.micro_batch_size=1", "precision=bf16-mixed"]


def memory(overrides: list[str]) -> int:
    cfg = parse_run_config(compose_train(overrides))
    predicted = predict_memory(cfg, parallel_layout(cfg))
    assert predicted is not None
    return predicted.total


def test_layout_of_a_deepspeed_run() -> None:
    cfg = parse_run_config(compose_train(["strategy=deepspeed", "strategy.stage=3", *LLAMA7B_8XA100]))
    strategy = DeepSpeedConfig(stage=3, activation_checkpointing=True, offload_optimizer=True)
    layout = layout_of(strategy, world_layout(cfg), batch_plan(cfg))
    assert (layout.strategy, layout.zero_stage, layout.dp, layout.recompute) == ("deepspeed", 3, 8, "full")
    assert layout.offload_optimizer and not layout.offload_params
    assert layout.options()["offload_params"] is False  # the planner speaks the config's key names


def test_memory_prediction_follows_the_zero_stage() -> None:
    ddp = memory(["strategy=ddp", *LLAMA7B_8XA100])
    zero = [memory(["strategy=deepspeed", f"strategy.stage={s}", *LLAMA7B_8XA100]) for s in (1, 2, 3)]
    assert ddp > zero[0] > zero[1] > zero[2]
    offloaded = memory(["strategy=deepspeed", "strategy.stage=3", "strategy.offload_optimizer=true", *LLAMA7B_8XA100])
    assert offloaded < zero[2]
    recompute = memory(["strategy=deepspeed", "strategy.activation_checkpointing=true", *LLAMA7B_8XA100])
    assert recompute < zero[1]


def test_auto_candidates_offload_only_on_gpus() -> None:
    cpu = auto_candidates(parse_run_config(compose_train(["strategy=auto"])))
    gpu = auto_candidates(parse_run_config(compose_train(["strategy=auto", *LLAMA7B_8XA100])))
    stages = {c.stage for c in cpu if isinstance(c, DeepSpeedConfig)}
    assert stages == {1, 2, 3} and isinstance(cpu[0], DDPConfig)
    assert not [c for c in cpu if isinstance(c, DeepSpeedConfig) and (c.offload_optimizer or c.offload_params)]
    offloads = [c for c in gpu if isinstance(c, DeepSpeedConfig) and c.offload_optimizer]
    assert {c.stage for c in offloads} == {1, 2, 3}
    assert [c.stage for c in gpu if isinstance(c, DeepSpeedConfig) and c.offload_params] == [3]


def resolved(overrides: list[str]):
    cfg = parse_run_config(compose_train(["strategy=auto", *overrides]))
    return resolve_auto(cfg, parallel_layout(cfg))


def test_auto_picks_zero3_with_offload_for_llama70b_on_two_h100_nodes() -> None:
    cfg, why = resolved(["model=llama-70b", "hw=2x8xh100", "trainer.micro_batch_size=1", "precision=bf16-mixed"])
    assert isinstance(cfg.strategy, DeepSpeedConfig)
    assert (cfg.strategy.stage, cfg.strategy.offload_optimizer) == (3, True)
    assert "ZeRO-3" in why and "ddp/fsdp/deepspeed/megatron layouts that fit" in why
    validate_run(cfg)  # what auto chose is a valid run (offload is allowed on a GPU profile)


def test_auto_prefers_the_simpler_stack_on_a_near_tie() -> None:
    # FSDP2 full shard and ZeRO-3 move the same bytes; their predicted steps differ by rounding only.
    cfg, _ = resolved(["model=gpt2-124m", "hw=8xa100", "precision=bf16-mixed"])
    assert isinstance(cfg.strategy, FSDPConfig)


def _memory_pressure() -> Finding:
    return Finding(kind="memory_pressure", severity="warning", ranks=[0], evidence={}, message="95% of memory used")


def _ctx(strategy: dict, accelerator: str = "gpu") -> RunContext:
    config = {
        "strategy": strategy,
        "hw": {"accelerator": accelerator, "devices_per_node": 8},
        "trainer": {"micro_batch_size": 1},
        "precision": {"name": "bf16-mixed"},
    }
    return RunContext(config, {"micro_batch_size": 1, "global_batch_size": 8, "data_parallel_size": 8}, 64)


def test_memory_pressure_under_zero_recommends_recompute_next_stage_then_offload() -> None:
    stage2 = {"name": "deepspeed", "stage": 2, "activation_checkpointing": False, "offload_optimizer": False}
    overrides = [r.override for r in recommend(_memory_pressure(), _ctx(stage2))]
    assert overrides.index("strategy.activation_checkpointing=true") < overrides.index("strategy.stage=3")
    assert overrides.index("strategy.stage=3") < overrides.index("strategy.offload_optimizer=true")
    on_cpu = [r.override for r in recommend(_memory_pressure(), _ctx({**stage2, "stage": 3}, "cpu"))]
    assert "strategy.offload_optimizer=true" not in on_cpu and not [o for o in on_cpu if "strategy.stage" in o]
    ddp = [r.override for r in recommend(_memory_pressure(), _ctx({"name": "ddp", "bucket_cap_mb": 25}))]
    assert "strategy=deepspeed" in ddp


# The schedule was built on the original optimizer, whose step() it had wrapped to check the call order.
@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_swap_optimizer_keeps_groups_hyperparameters_and_schedule() -> None:
    from disttrain.strategies.deepspeed import swap_optimizer

    model = torch.nn.Linear(4, 4)
    groups = [{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias], "weight_decay": 0.0}]
    original = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(original, lambda step: 0.5 ** (step + 1))
    # torch's Adam stands in for DeepSpeedCPUAdam, whose C++ op would be compiled on construction.
    swapped = swap_optimizer(original, schedule, torch.optim.Adam)
    assert isinstance(swapped, torch.optim.Adam) and schedule.optimizer is swapped
    assert [g["weight_decay"] for g in swapped.param_groups] == [0.1, 0.0]
    assert [g["params"] for g in swapped.param_groups] == [[model.weight], [model.bias]]
    assert swapped.defaults["betas"] == (0.9, 0.95) and swapped.param_groups[0]["lr"] == pytest.approx(1.5e-3)
    swapped.step()
    schedule.step()
    assert [g["lr"] for g in swapped.param_groups] == pytest.approx([7.5e-4, 7.5e-4])


def test_a_cpu_run_names_deepspeeds_accelerator_so_its_import_does_not_warn_on_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    from disttrain.strategies.deepspeed import build_deepspeed

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    build_deepspeed(DeepSpeedConfig(stage=3), 4, "nccl", lambda module: None)
    assert "DS_ACCELERATOR" not in os.environ  # a GPU run: DeepSpeed finds its CUDA itself
    build_deepspeed(DeepSpeedConfig(stage=2), 4, "gloo", lambda module: None)
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")  # a user's own choice wins
    build_deepspeed(DeepSpeedConfig(stage=2), 4, "gloo", lambda module: None)
    assert os.environ["DS_ACCELERATOR"] == "xpu"
