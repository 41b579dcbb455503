"""The strategy specs: one answer per strategy for data-parallel size, schedule, loader batch, planner layout."""

from __future__ import annotations

import subprocess
import sys

import pytest

from disttrain.config.errors import ConfigError
from disttrain.config.parse import parse_run_config
from disttrain.config.schema import RunConfig
from disttrain.config.strategy_schema import AutoStrategyConfig, DDPConfig, DeepSpeedConfig, FSDPConfig, MegatronConfig
from disttrain.planner import Layout
from disttrain.strategies.auto import megatron_config_of
from disttrain.strategies.auto_spec import AutoSpec
from disttrain.strategies.ddp_spec import DDPSpec
from disttrain.strategies.deepspeed_spec import DeepSpeedSpec
from disttrain.strategies.fsdp_spec import FSDPSpec
from disttrain.strategies.megatron_spec import MegatronSpec
from disttrain.strategies.registry import spec_of
from tests.conftest import compose_train


def run_config(overrides: list[str]) -> RunConfig:
    return parse_run_config(compose_train(overrides))


@pytest.mark.parametrize(
    ("config", "spec"),
    [
        (DDPConfig(), DDPSpec),
        (FSDPConfig(), FSDPSpec),
        (DeepSpeedConfig(stage=3), DeepSpeedSpec),
        (MegatronConfig(tp=2), MegatronSpec),
        (AutoStrategyConfig(), AutoSpec),
    ],
)
def test_every_strategy_config_has_its_spec(config: object, spec: type) -> None:
    assert type(spec_of(config)) is spec
    assert spec_of(config).config is config


def test_spec_module_loads_without_torch_or_lightning() -> None:
    code = (
        "import sys, disttrain.strategies.registry, disttrain.strategies.auto, disttrain.config.validate; "
        "assert not {'torch', 'lightning'} & set(sys.modules), sorted(m for m in sys.modules if 'torch' in m)[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_megatron_shards_data_over_world_over_tp_times_pp_and_loads_whole_steps() -> None:
    spec = spec_of(MegatronConfig(tp=2, pp=2, microbatches=4))
    assert spec.data_parallel_size(8) == 2
    assert spec.schedule_microbatches == 4
    # The engine splits a whole step's micro-batches itself: one loader batch per step.
    assert spec.loader_batch_size(micro_batch_size=3, accumulation=8) == 24
    assert spec.engine_runs_the_step and not spec.recomputes_activations
    assert spec_of(MegatronConfig(activation_checkpointing="full")).recomputes_activations
    assert not spec_of(MegatronConfig(activation_checkpointing="selective")).recomputes_activations


@pytest.mark.parametrize("config", [DDPConfig(), FSDPConfig(activation_checkpointing=True), DeepSpeedConfig()])
def test_data_parallel_strategies_load_one_micro_batch_over_every_process(config: object) -> None:
    spec = spec_of(config)
    assert spec.data_parallel_size(8) == 8 and spec.schedule_microbatches == 1
    assert spec.loader_batch_size(micro_batch_size=3, accumulation=8) == 3
    assert not spec.engine_runs_the_step
    assert spec.recomputes_activations == getattr(config, "activation_checkpointing", False)


def test_only_ddp_runs_one_process_without_its_strategy() -> None:
    assert not spec_of(DDPConfig()).wraps_one_process
    assert all(spec_of(c).wraps_one_process for c in (FSDPConfig(), DeepSpeedConfig(), MegatronConfig()))


def test_planner_layouts_carry_each_strategys_settings() -> None:
    fsdp = spec_of(FSDPConfig(reshard_after_forward=False, dp_replicate=2)).planner_layout(dp=8, accumulation=2)
    assert (fsdp.strategy, fsdp.dp, fsdp.microbatches, fsdp.reshard_after_forward, fsdp.dp_replicate) == (
        "fsdp",
        8,
        2,
        False,
        2,
    )
    zero = spec_of(DeepSpeedConfig(stage=3, activation_checkpointing=True)).planner_layout(dp=4, accumulation=1)
    assert (zero.strategy, zero.zero_stage, zero.recompute) == ("deepspeed", 3, "full")
    assert spec_of(DDPConfig()).planner_layout(dp=4, accumulation=3) == Layout("ddp", dp=4, microbatches=3)
    with pytest.raises(ValueError, match="auto"):
        spec_of(AutoStrategyConfig()).planner_layout(dp=4, accumulation=1)


def test_megatron_layout_and_config_are_inverse() -> None:
    config = MegatronConfig(tp=2, pp=2, schedule="gpipe", microbatches=4, activation_checkpointing="selective")
    layout = spec_of(config).planner_layout(dp=2, accumulation=4)
    assert (layout.tp, layout.pp, layout.schedule, layout.schedule_microbatches, layout.recompute) == (
        2,
        2,
        "gpipe",
        4,
        "selective",
    )
    back = megatron_config_of(layout)
    assert (back.tp, back.pp, back.schedule, back.num_microbatches, back.activation_checkpointing) == (
        config.tp,
        config.pp,
        config.schedule,
        config.num_microbatches,
        config.activation_checkpointing,
    )
    for dp_type, replicas, expected in (("hsdp", 2, 2), ("replicate", 4, 1), ("fsdp", 1, 1)):
        layout = Layout("megatron", dp=4, tp=2, dp_type=dp_type, dp_replicate=replicas)
        back = megatron_config_of(layout)
        assert (back.dp_type, back.dp_replicate) == (dp_type, expected)
        assert spec_of(back).planner_layout(dp=4, accumulation=1).dp_replicate == replicas
    with pytest.raises(ValueError, match="distributed_optimizer"):
        megatron_config_of(Layout("megatron", dp=4, dp_type="distributed_optimizer"))


def test_each_spec_validates_its_own_settings() -> None:
    with pytest.raises(ConfigError, match=r"strategy\.stage"):
        spec_of(DeepSpeedConfig(stage=4)).validate(run_config(["strategy=deepspeed"]))
    with pytest.raises(ConfigError, match=r"strategy\.dp_replicate"):
        spec_of(FSDPConfig(dp_replicate=3)).validate(run_config(["strategy=fsdp"]))
    with pytest.raises(ConfigError, match=r"strategy\.comm_hook"):
        spec_of(DDPConfig(comm_hook="bf16")).validate(run_config(["hw.devices_per_node=1"]))
    spec_of(DDPConfig(comm_hook="bf16")).validate(run_config([]))  # 2 processes: the hook has bytes to halve
