"""The generated diagnosis matrix (benchmarks/diagnosis_matrix.py): what a seed draws, and what each draw runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.diagnosis_matrix import FAULTS, MODELS, STRATEGIES, Draw, compatible, draw_matrix


@pytest.mark.parametrize("seed", [0, 1, 2, 7])
def test_a_seed_draws_a_covering_matrix_of_runnable_scenarios(seed: int) -> None:
    draws = draw_matrix(seed, 40)
    assert len(draws) >= 40
    assert {d.fault for d in draws} == set(FAULTS)
    assert {d.strategy for d in draws} == set(STRATEGIES)
    assert all(compatible(d.strategy, d.fault, d.model) for d in draws)
    sized = [d.magnitude for d in draws if d.fault != "none"]
    assert all(0.1 <= m <= 3.0 for m in sized)
    assert any(m < 0.5 for m in sized) and any(m > 1.0 for m in sized)  # small and large faults both
    assert draw_matrix(seed, 40) == draws  # reproducible
    assert draw_matrix(seed + 100, 40) != draws  # a new seed, a new matrix


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_draw_composes_with_the_real_config(world: int) -> None:
    """Both arms of every cell (strategy x fault x model) compose and validate as ``python -m train`` would."""
    from disttrain.config.parse import parse_run_config
    from disttrain.strategies.layout import validate_run
    from tests.conftest import compose_train

    commands: set[tuple[str, ...]] = set()  # a counterfactual is shared by every fault of its cell: composed once
    for strategy in STRATEGIES:
        for fault in FAULTS:
            for model in MODELS:
                if not compatible(strategy, fault, model, world):
                    continue
                rank = None if fault == "data-all" else world - 1
                for work in ("sleep", "compute") if world == 2 else ("sleep",):  # a fault's keys: the same anywhere
                    draw = Draw(strategy, fault, rank, 0.5, model, 5 if fault == "stall" else 1, world, work)
                    arms = (draw.counterfactual(), draw.fault_overrides(0.2))
                    commands.update(tuple(overrides) for overrides in arms)
    for overrides in sorted(commands):
        cfg = parse_run_config(compose_train(list(overrides)))
        validate_run(cfg)
        assert cfg.hw.devices_per_node * cfg.hw.num_nodes == world


def test_a_four_rank_matrix_draws_its_slow_rank_among_four_and_expects_every_rank_where_all_are_slow() -> None:
    draws = draw_matrix(3, 40, world=4)
    assert all(d.world == 4 and "hw.devices_per_node=4" in d.counterfactual() for d in draws)
    assert {d.rank for d in draws if d.rank is not None} == {0, 1, 2, 3}
    assert all(d.name.endswith("-w4") for d in draws)
    assert Draw("ddp", "data-all", None, 1.0, "hf", world=4).expected(0.3) == ("input_bound", [0, 1, 2, 3])
    assert Draw("ddp", "slow-link", None, 1.0, "builtin", world=4).expected(0.4) == ("comm_bound", [0, 1, 2, 3])
    assert Draw("fsdp", "backward", 2, 1.0, "user", world=4).expected(0.4) == ("straggler", [2])
    assert "hw.devices_per_node=4" not in Draw("ddp", "none", None, 0.0, "user").counterfactual()  # 2: the default


def test_an_odd_world_draws_no_layout_it_cannot_split() -> None:
    draws = draw_matrix(5, 20, world=3)
    assert {d.strategy for d in draws} == {"ddp", "fsdp", "deepspeed-2", "deepspeed-3"}
    assert {d.rank for d in draws if d.rank is not None} <= {0, 1, 2}


def test_the_expected_finding_follows_the_measured_cost() -> None:
    slow = Draw("ddp", "backward", 0, 1.0, "user")
    assert slow.expected(0.4) == ("straggler", [0])
    assert slow.expected(0.02) == (None, [])  # smaller than any warning: a quiet report is right
    link = Draw("ddp", "slow-link", None, 0.3, "builtin")
    assert link.expected(0.4)[0] == "comm_bound" and link.expected(0.1)[0] == "low_overlap"
    assert Draw("fsdp", "stall", 1, 1.0, "builtin", 6).expected(0.2) == ("input_bound", [1])  # the loader stalls
    assert Draw("fsdp", "stall", 1, 1.0, "user", 6).expected(0.2) == ("straggler", [1])  # the forward stalls
    assert Draw("ddp", "data-all", None, 1.0, "hf").expected(0.3) == ("input_bound", [0, 1])
    fault = Draw("ddp", "optimizer", 1, 0.5, "builtin").fault_overrides(0.4)
    assert "+data.optimizer_sleep_s=0.2" in fault and "+data.slow_ranks=[1]" in fault


def test_a_healthy_ddp_draw_is_measured_against_local_gradients_and_other_layouts_own_comm_is_not_judged() -> None:
    healthy = Draw("ddp", "none", None, 0.0, "user")
    assert "+data.local_grads=true" in healthy.counterfactual()
    assert "+data.local_grads=true" not in healthy.fault_overrides(0.1)  # the run judged keeps its all-reduce
    assert "+data.local_grads=true" not in Draw("ddp", "backward", 1, 0.5, "user").counterfactual()
    assert healthy.inherent == ()
    assert set(Draw("fsdp", "none", None, 0.0, "user").inherent) == {"low_overlap", "comm_bound"}
    assert set(Draw("megatron-pp2", "data-all", None, 0.3, "builtin").inherent) == {
        "pipeline_bubble", "low_overlap", "comm_bound"}  # fmt: skip


def test_work_holds_a_fault_computing_without_changing_which_scenarios_a_seed_draws() -> None:
    asleep, mixed, computing = (draw_matrix(11, 30, work=work) for work in ("sleep", "mixed", "compute"))
    assert [replace(d, work="sleep") for d in mixed] == asleep == [replace(d, work="sleep") for d in computing]
    assert {d.work for d in asleep} == {"sleep"}
    assert {d.work for d in mixed} == {"sleep", "compute"}  # drawn per scenario
    assert all(d.work == "sleep" for d in computing if d.fault in ("none", "slow-link"))  # nothing held / a wait
    assert all(d.name.endswith("-cpu") == (d.work == "compute") for d in mixed)
    assert draw_matrix(11, 30, work="mixed") == mixed  # reproducible
    with pytest.raises(ValueError, match="work"):
        draw_matrix(11, 30, work="busy")


@pytest.mark.parametrize(
    ("fault", "model", "key"),
    [("backward", "user", "+model.work=compute"), ("optimizer", "builtin", "+data.work=compute"),
     ("data-one", "hf", "+data.work=compute"), ("stall", "user", "+model.work=compute"),
     ("stall", "builtin", "+data.work=compute")],
)  # fmt: skip
def test_a_computing_fault_reaches_the_code_that_holds_its_rank(fault: str, model: str, key: str) -> None:
    draw = Draw("ddp", fault, 1, 0.5, model, 5 if fault == "stall" else 1, work="compute")
    assert key in draw.fault_overrides(0.2)
    assert not any(".work=" in o for o in draw.counterfactual())  # the counterfactual has no fault to hold
    assert not any(".work=" in o for o in replace(draw, work="sleep").fault_overrides(0.2))  # sleep: the default
