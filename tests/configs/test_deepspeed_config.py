"""strategy=deepspeed: conf/strategy/deepspeed.yaml composes to the schema, builds the strategy, and every invalid
combination stops before launch with its own message."""

from __future__ import annotations

from pathlib import Path

import pytest

from disttrain.config.errors import ConfigError
from disttrain.config.parse import parse_run_config
from disttrain.config.strategy_schema import DeepSpeedConfig
from disttrain.models import apply_activation_checkpointing
from disttrain.models.facts import ModelFacts
from disttrain.planner import Layout
from disttrain.strategies.layout import parallel_layout, validate_run
from disttrain.strategies.registry import build_strategy
from disttrain.training.build import build_trainer
from tests.conftest import compose_train


def parsed(overrides: list[str]):
    return parse_run_config(compose_train(["strategy=deepspeed", *overrides]))


def test_yaml_defaults_are_the_schema_defaults() -> None:
    assert parsed([]).strategy == DeepSpeedConfig()
    cfg = parsed(["strategy.stage=3", "strategy.reduce_bucket_size=50000000", "strategy.overlap_comm=false"])
    assert (cfg.strategy.stage, cfg.strategy.overlap_comm) == (3, False)


def test_bucket_sizes_must_be_whole_elements() -> None:
    with pytest.raises(ConfigError) as info:
        parsed(["strategy.reduce_bucket_size=5e7"])  # YAML reads 5e7 as a float; DeepSpeed counts elements
    assert info.value.key == "strategy.reduce_bucket_size" and "int" in info.value.problem


def test_strategy_and_config_dict(tmp_path: Path) -> None:
    cfg = parsed(["strategy.stage=3", "strategy.param_persistence_threshold=0", "hw.devices_per_node=1"])
    parallel = parallel_layout(cfg)
    plan = parallel.batch
    built = build_strategy(cfg, 1, apply_activation_checkpointing)
    from disttrain.strategies.deepspeed import CPUCapableDeepSpeedStrategy

    assert isinstance(built.strategy, CPUCapableDeepSpeedStrategy) and built.parallelize is not None
    zero = built.strategy.config["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_param_persistence_threshold"] == 0
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 200_000_000
    assert "offload_optimizer" not in zero and "offload_param" not in zero
    assert built.strategy.config["train_micro_batch_size_per_gpu"] == plan.micro_batch_size
    # One process still gets DeepSpeed when it was asked for (ZeRO changes the optimizer even alone).
    parts = build_trainer(cfg, parallel, built, tmp_path, ModelFacts(1, 1.0))
    assert parts.trainer.strategy is built.strategy


def test_offload_options_reach_the_deepspeed_config() -> None:
    from disttrain.strategies.deepspeed import deepspeed_config

    zero = deepspeed_config(DeepSpeedConfig(stage=3, offload_optimizer=True, offload_params=True), 4)[
        "zero_optimization"
    ]
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    assert (
        "stage3_param_persistence_threshold" not in deepspeed_config(DeepSpeedConfig(stage=2), 4)["zero_optimization"]
    )


BAD = [
    (["strategy.stage=4"], "strategy.stage", "is not a ZeRO stage", "strategy.stage=1, 2 or 3"),
    (["strategy.stage=0"], "strategy.stage", "is not a ZeRO stage", "strategy=ddp for no sharding"),
    (["strategy.offload_optimizer=true"], "strategy.offload_optimizer", "DeepSpeedCPUAdam", "GPU hw profile"),
    (["strategy.stage=3", "strategy.offload_params=true"], "strategy.offload_params", "GPUs", "GPU hw profile"),
    (
        ["hw=8xa100", "strategy.stage=2", "strategy.offload_params=true"],
        "strategy.offload_params",
        "needs ZeRO stage 3",
        "strategy.stage=3",
    ),
    (["strategy.reduce_bucket_size=0"], "strategy.reduce_bucket_size", "must be > 0", "=200000000"),
    (["strategy.allgather_bucket_size=-5"], "strategy.allgather_bucket_size", "must be > 0", "=200000000"),
    (["strategy.param_persistence_threshold=-1"], "strategy.param_persistence_threshold", ">= 0", "=100000"),
    (["precision=fp16-mixed"], "precision", "not supported on CPU", "bf16-mixed"),
    (["+strategy.offload_parameters=true"], "strategy.offload_parameters", "did you mean", "offload_params"),
]


@pytest.mark.parametrize(("overrides", "key", "problem", "fix"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_invalid_combination_has_its_message(overrides: list[str], key: str, problem: str, fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_run(parsed(overrides))
    assert info.value.key == key
    assert problem in info.value.problem, info.value.problem
    assert fix in info.value.fix, info.value.fix


def test_offload_on_a_gpu_profile_is_valid() -> None:
    cfg = parsed(["hw=8xa100", "strategy.stage=3", "strategy.offload_optimizer=true", "strategy.offload_params=true"])
    validate_run(cfg)


@pytest.mark.parametrize(
    "layout",
    [
        Layout("deepspeed", dp=8, zero_stage=1),
        Layout("deepspeed", dp=8, zero_stage=2, offload_optimizer=True, recompute="full"),
        Layout("deepspeed", dp=8, zero_stage=3, offload_optimizer=True, offload_params=True),
    ],
    ids=lambda layout: layout.label(),
)
def test_planner_overrides_are_valid_config(layout: Layout) -> None:
    """What `python -m plan` recommends for a ZeRO layout is a command `python -m train` accepts."""
    cfg = parse_run_config(compose_train([*layout.overrides(), "hw=8xa100"]))
    validate_run(cfg)
    assert cfg.strategy.stage == layout.zero_stage
    assert (cfg.strategy.offload_optimizer, cfg.strategy.offload_params) == (
        layout.offload_optimizer,
        layout.offload_params,
    )
