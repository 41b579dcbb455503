"""Each strategy's planner terms: one registered ``StrategyTerms`` per strategy the trainer builds, complete by
construction, and the only place a layout's strategy is asked about."""

from __future__ import annotations

from typing import Any

import pytest

from disttrain.planner import Layout
from disttrain.planner.spec import StrategyTerms, planned_strategies, terms_of
from disttrain.strategies.registry import built_strategies


def test_every_strategy_the_trainer_builds_has_planner_terms_and_no_other() -> None:
    built = set(built_strategies()) - {"auto"}
    assert set(planned_strategies()) == built
    assert planned_strategies() == ("ddp", "fsdp", "deepspeed", "megatron")  # the order tables and messages use


def test_a_layout_asks_its_own_strategy_for_its_terms() -> None:
    for name in planned_strategies():
        layout = Layout(name, dp=2, zero_stage=2 if name == "deepspeed" else 0)
        assert layout.terms is terms_of(name) and layout.terms.name == name


def test_terms_missing_a_formula_fail_when_defined_not_with_a_wrong_prediction() -> None:
    before = planned_strategies()
    with pytest.raises(
        TypeError, match="HalfDone leaves abstract terms undefined: comm, model_states, optimizer_parameters"
    ):

        class HalfDone(StrategyTerms):  # no model_states, comm or optimizer_parameters
            name = "half_done"

            def options(self, layout: Layout) -> dict[str, Any]:
                return {}

            def label(self, layout: Layout) -> str:
                return "half"

    assert planned_strategies() == before  # nothing registered


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "fsdp", "onebit_adam": True}, "1-bit Adam runs under DDP only, not fsdp"),
        ({"strategy": "deepspeed", "dp": 4, "ep": 2, "zero_stage": 2}, "runs under FSDP only"),
        ({"strategy": "fsdp", "dp": 6, "ep": 4}, "FSDP2 full shard over a world it divides"),
        ({"strategy": "megatron", "dp": 4, "dp_type": "replicate"}, "dp_type=replicate needs dp_replicate=4"),
    ],
)
def test_degrees_a_strategy_cannot_run_are_refused_by_its_terms(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


def test_derived_options_are_given_as_auto_in_the_overrides() -> None:
    overrides = Layout("megatron", dp=2, tp=2).overrides()
    assert "strategy.dp=auto" in overrides and "strategy.tp=2" in overrides
    assert Layout("ddp", dp=2).overrides() == ["strategy=ddp"]


def test_a_second_class_for_a_strategy_is_refused_not_swapped_in() -> None:
    ddp = terms_of("ddp")
    with pytest.raises(TypeError, match="strategy 'ddp' has terms already"):

        class AnotherDDP(type(ddp)):  # type: ignore[misc]
            pass

    assert terms_of("ddp") is ddp
