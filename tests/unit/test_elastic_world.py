"""An elastic restart (torchrun --nnodes=min:max, a requeued SLURM job) that finds another number of ranks trains on
them at the same global batch: pure config math, no processes."""

from __future__ import annotations

import pytest

from disttrain.config.errors import ConfigError
from disttrain.config.parse import parse_run_config
from disttrain.config.schema import RunConfig
from disttrain.config.validate import BatchPlan
from disttrain.job.prepare import fit_elastic_world, launched_per_node
from disttrain.strategies.layout import validate_run
from tests.conftest import TINY_MODEL, compose_train


def two_rank_run() -> tuple[RunConfig, BatchPlan]:
    cfg = parse_run_config(compose_train([*TINY_MODEL, "hw.devices_per_node=2", "trainer.micro_batch_size=4"]))
    return cfg, validate_run(cfg)


def test_fewer_ranks_keep_the_global_batch_by_accumulating() -> None:
    cfg, plan = two_rank_run()
    assert (plan.global_batch_size, plan.accumulation) == (8, 1)
    adapted, _, note = fit_elastic_world(cfg, plan, launched=1, per_node=1)
    new = validate_run(adapted)
    assert (adapted.hw.num_nodes, adapted.hw.devices_per_node) == (1, 1)
    assert (new.global_batch_size, new.micro_batch_size, new.data_parallel_size, new.accumulation) == (8, 4, 1, 2)
    assert note == (
        "elastic restart: the launcher started 1 ranks (the run had 2); training on 1 x 1 at the same global batch "
        "8 = micro 4 x dp 1 x accumulation 2"
    )


def test_more_nodes_keep_the_global_batch_and_an_impossible_split_is_refused_with_the_key() -> None:
    cfg, plan = two_rank_run()
    adapted, _, _ = fit_elastic_world(cfg, plan, launched=4, per_node=2)
    new = validate_run(adapted)
    assert (adapted.hw.num_nodes, adapted.hw.devices_per_node) == (2, 2)
    assert (new.global_batch_size, new.micro_batch_size, new.data_parallel_size, new.accumulation) == (8, 2, 4, 1)
    with pytest.raises(
        ConfigError, match="the restart found 3 ranks instead of 2 and cannot keep the global batch of 8"
    ):
        fit_elastic_world(cfg, plan, launched=3, per_node=3)


def test_processes_per_node_come_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES"):
        monkeypatch.delenv(key, raising=False)
    assert launched_per_node(6) == 6
    monkeypatch.setenv("SLURM_NNODES", "3")
    assert launched_per_node(6) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert launched_per_node(6) == 3
