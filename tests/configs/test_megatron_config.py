"""strategy=megatron at compose time: degrees resolve, every invalid combination names its key and a valid
alternative, and every Megatron layout the planner recommends is a config that validates."""

from __future__ import annotations

import pytest

from disttrain.config.degrees import MegatronDegrees
from disttrain.config.errors import ConfigError
from disttrain.config.parse import parse_run_config
from disttrain.config.strategy_schema import MegatronConfig
from disttrain.planner.plan import plan
from disttrain.strategies.layout import validate_run, world_layout
from tests.conftest import compose_train, compose_train_each, hw_profile, model_preset


def validated(overrides: list[str]):
    cfg = parse_run_config(compose_train(overrides))
    return cfg, validate_run(cfg)


def test_defaults_and_dp_auto() -> None:
    cfg, batch = validated(["strategy=megatron", "strategy.tp=2", "strategy.pp=2", "hw.devices_per_node=8"])
    assert isinstance(cfg.strategy, MegatronConfig)
    assert world_layout(cfg).data_parallel_size == 2  # dp=auto: 8 / (2 x 2)
    # micro 16 x dp 2 x pp=2 micro-batches (the default, the fewest 1F1B allows)
    assert (batch.global_batch_size, batch.accumulation) == (64, 2)


def test_global_batch_adds_rounds_of_microbatches() -> None:
    overrides = ["strategy=megatron", "strategy.pp=2", "strategy.microbatches=4", "trainer.micro_batch_size=2"]
    _, batch = validated([*overrides, "trainer.global_batch_size=16"])
    assert (batch.data_parallel_size, batch.accumulation) == (1, 8)  # 2 rounds of 4 micro-batches


def test_degrees_map_ranks_like_the_device_mesh() -> None:
    """Row-major over (pp, dp_replicate, dp_shard, tp), the order init_device_mesh lays ranks out in."""
    degrees = MegatronDegrees(pp=2, dp_replicate=2, dp_shard=2, tp=2)
    assert degrees.coordinates(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "tp": 0, "dp": 0}
    assert degrees.coordinates(1)["tp"] == 1 and degrees.coordinates(1)["dp"] == 0
    assert degrees.coordinates(6) == {"pp": 0, "dp_replicate": 1, "dp_shard": 1, "tp": 0, "dp": 3}
    assert degrees.coordinates(15) == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1, "dp": 3}


MEGATRON = ["strategy=megatron", "hw.devices_per_node=8"]
# (overrides, the key the error must name, fragments the message must contain)
BAD = [
    ([*MEGATRON, "strategy.tp=3"], "strategy.tp", ["does not divide the world size 8", "tp=2 pp=2"]),
    ([*MEGATRON, "strategy.tp=8"], "strategy.tp", ["does not divide model.n_heads=6", "strategy.tp in [1, 2]"]),
    (
        [*MEGATRON, "hw.devices_per_node=16", "model=llama-1b", "strategy.tp=16"],
        "strategy.tp",
        ["does not divide model.n_kv_heads=8", "strategy.tp in [1, 2, 4, 8]"],
    ),
    (
        [*MEGATRON, "strategy.pp=8"],
        "strategy.pp",
        ["n_layers=4 does not split evenly", "pp x virtual_stages in [2, 4]"],
    ),
    ([*MEGATRON, "strategy.pp=2", "strategy.microbatches=1"], "strategy.microbatches", ["at least pp=2", ">=2"]),
    (
        [*MEGATRON, "strategy.pp=2", "strategy.schedule=interleaved_1f1b"],
        "strategy.virtual_stages",
        ["several model chunks", "virtual_stages=2"],
    ),
    (
        [
            *MEGATRON,
            "strategy.pp=2",
            "strategy.schedule=interleaved_1f1b",
            "strategy.virtual_stages=2",
            "strategy.microbatches=3",
        ],
        "strategy.microbatches",
        ["divisible by pp=2", "microbatches=4"],
    ),
    (
        [*MEGATRON, "strategy.pp=2", "strategy.schedule=zero_bubble", "strategy.virtual_stages=3"],
        "strategy.virtual_stages",
        ["exactly 2 chunks", "virtual_stages=2"],
    ),
    ([*MEGATRON, "strategy.pp=2", "strategy.schedule=1f1f"], "strategy.schedule", ["did you mean '1f1b'"]),
    ([*MEGATRON, "strategy.virtual_stages=2"], "strategy.virtual_stages", ["pipeline parallelism", "=1"]),
    ([*MEGATRON, "strategy.tp=2", "strategy.dp=3"], "strategy.dp", ["not the world size 8", "strategy.dp=4"]),
    ([*MEGATRON, "strategy.dp_type=zero"], "strategy.dp_type", ["not a data-parallel flavour", "hsdp"]),
    ([*MEGATRON, "strategy.dp_type=hsdp", "strategy.dp_replicate=3"], "strategy.dp_replicate", ["do not divide dp=8"]),
    ([*MEGATRON, "strategy.dp_replicate=2"], "strategy.dp_replicate", ["only applies to strategy.dp_type=hsdp"]),
    (
        [*MEGATRON, "strategy.activation_checkpointing=true"],
        "strategy.activation_checkpointing",
        ["expected str"],
    ),
    (
        [*MEGATRON, "strategy.activation_checkpointing=some"],
        "strategy.activation_checkpointing",
        ["'some' is not one of", "selective"],
    ),
    (
        [*MEGATRON, "strategy.tp=2", "strategy.sequence_parallel=true", "model.seq_len=127"],
        "strategy.sequence_parallel",
        ["seq_len=127 does not divide by tp=2"],
    ),
    (
        [*MEGATRON, "strategy.tp=2", "strategy.pp=2", "trainer.global_batch_size=100"],
        "trainer.global_batch_size",
        ["2 microbatches", "multiple of 64"],
    ),
    (["strategy=megatron", "+model._target_=tests.plugins.BigramModel"], "strategy", ["user model"]),
]


@pytest.mark.parametrize(("overrides", "key", "fragments"), BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_invalid_layouts_name_the_key_and_a_fix(overrides: list[str], key: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as raised:
        validated(overrides)
    assert raised.value.key == key
    for fragment in fragments:
        assert fragment in str(raised.value)


@pytest.mark.parametrize(("model", "hw"), [("llama-7b", "8xa100"), ("llama-70b", "2x8xh100")])
def test_every_planned_megatron_layout_is_a_valid_config(model: str, hw: str) -> None:
    """The overrides `python -m plan` prints for Megatron (and FSDP2 hybrid) layouts select exactly that layout
    and validate."""
    result = plan(model_preset(model), hw_profile(hw), micro_batch_size=1, global_batch_size=64)
    megatron = [c for c in result.candidates if c.layout.strategy == "megatron"]
    assert len(megatron) > 20
    hybrid = [c for c in result.candidates if c.layout.strategy == "fsdp" and c.layout.dp_replicate > 1]
    assert bool(hybrid) == (hw == "2x8xh100")  # FSDP2 hybrid is planned only across nodes
    base = [f"model={model}", f"hw={hw}", "precision=bf16-mixed", "trainer.micro_batch_size=1"]
    base.append("trainer.global_batch_size=64")
    variants = [c.layout.overrides() for c in [*hybrid, *megatron]]
    composed = compose_train_each(base, variants)
    # The shared compose is Hydra's own: for the first layout of each kind, the same config as a full compose.
    for first in {0, len(hybrid)} - {len(variants)}:
        assert composed[first] == compose_train([*base, *variants[first]])
    for candidate, raw in zip(hybrid, composed[: len(hybrid)], strict=True):
        cfg = parse_run_config(raw)
        validate_run(cfg)
        assert cfg.strategy.dp_replicate == candidate.layout.dp_replicate
    for candidate, raw in zip(megatron, composed[len(hybrid) :], strict=True):
        cfg = parse_run_config(raw)
        batch = validate_run(cfg)
        s, layout = cfg.strategy, candidate.layout
        assert (s.tp, s.pp, world_layout(cfg).data_parallel_size) == (layout.tp, layout.pp, layout.dp)
        assert batch.accumulation == layout.microbatches
