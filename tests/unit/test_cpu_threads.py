"""How many intra-op threads a CPU rank takes: the config, else OMP_NUM_THREADS, else its share of the cores."""

from __future__ import annotations

import os

import pytest

from disttrain.launch.env import cpu_threads


@pytest.mark.parametrize(
    ("configured", "environ", "expected"),
    [
        (3, {"OMP_NUM_THREADS": "1"}, 3),  # trainer.num_threads wins over the environment
        (None, {"OMP_NUM_THREADS": "1"}, 1),
        (None, {"OMP_NUM_THREADS": " 5,2 "}, 5),  # OpenMP's nested list: the outer level is the process's
    ],
)
def test_the_config_then_omp_num_threads(configured: int | None, environ: dict[str, str], expected: int) -> None:
    assert cpu_threads(configured, 2, environ) == expected


@pytest.mark.parametrize("omp", ["", "0", "-2", "many"])
def test_without_a_usable_omp_num_threads_the_local_ranks_share_the_cores(
    omp: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert cpu_threads(None, 2, {"OMP_NUM_THREADS": omp}) == 4
    assert cpu_threads(None, 16, {}) == 1  # more ranks than cores: one thread each, never zero
