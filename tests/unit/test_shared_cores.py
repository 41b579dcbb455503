"""A fix of a wait on a CPU host whose ranks share its cores gains at most the cores the run left idle
(diagnostics/analysis/shared_cores.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diagnostics.analysis import Finding
from diagnostics.diagnosis import analyse
from tests.diag_fixtures import write_run

FOUR_RANKS = ("hw.devices_per_node=4",)


def found(tmp_path: Path, **changes: object) -> dict[str, Finding]:
    return {f.kind: f for f in analyse(write_run(tmp_path / "run", "healthy", **changes)).findings}


def slow_forward(**changes: object) -> dict[str, object]:
    # Rank 2 waits 0.3 s in forward each step (~43% of the job's step if its core stood idle meanwhile).
    return {"overrides": FOUR_RANKS, "slow_rank": 2, "slow_phase": "forward", "slow_s": 0.3, **changes}


def test_a_wait_on_four_ranks_sharing_two_cores_costs_no_more_than_the_idle_cores(tmp_path: Path) -> None:
    unbounded = found(tmp_path / "a", **slow_forward(cpu_count=None))["straggler"]
    assert unbounded.cost_fraction > 0.35 and "shared_cores" not in unbounded.evidence
    # The ranks kept the 2 cores 80% busy: the slow rank's wait mostly lent its core to the others.
    straggler = found(tmp_path / "b", **slow_forward(cpu_count=2, cpu_util=(40.0, 40.0, 40.0, 40.0)))["straggler"]
    assert straggler.ranks == [2] and straggler.cost_fraction == pytest.approx(0.2, abs=0.005)
    shared = straggler.evidence["shared_cores"]
    assert shared["cores"] == 2 and shared["ranks"] == [0, 1, 2, 3] and shared["busy_share"] == pytest.approx(0.8)
    assert shared["cost_before_bound"] == pytest.approx(unbounded.cost_fraction, abs=0.01)
    assert "bounded by the 20% of node0's 2 cores the run left idle" in straggler.cost["basis"]
    assert straggler.severity == "warning"


def test_a_core_per_thread_or_an_unknown_host_leaves_the_cost_alone(tmp_path: Path) -> None:
    busy = (40.0, 40.0, 40.0, 40.0)
    for n, cores in enumerate((4, 8)):  # 4 ranks x 1 thread on 4 or 8 cores: a waiting rank's core idles
        straggler = found(tmp_path / str(n), **slow_forward(cpu_count=cores, cpu_util=busy))["straggler"]
        assert straggler.cost_fraction > 0.35 and "shared_cores" not in straggler.evidence


def test_a_slow_ranks_extra_cpu_work_is_gained_on_top_of_the_idle_cores(tmp_path: Path) -> None:
    # The slow rank uses 30 points of a core more than the others: removing its extra work frees 15% of 2 cores.
    straggler = found(tmp_path, **slow_forward(cpu_count=2, cpu_util=(40.0, 40.0, 70.0, 40.0)))["straggler"]
    assert straggler.cost_fraction == pytest.approx(1 - 1.9 / 2 + 0.15, abs=0.005)


def test_a_loader_wait_that_lends_its_core_is_graded_on_what_the_host_really_left_idle(tmp_path: Path) -> None:
    """One rank's loader sleeps 20% of the step while the host stays 93% busy: a few percent to gain at most. The
    idle share is graded less the share every rank spends in collectives together (a healthy run's idle)."""
    loader = {"overrides": FOUR_RANKS, "slow_rank": 1, "slow_phase": "data", "slow_s": 0.08, "data_cpu": 0.0}
    unbounded = found(tmp_path / "a", **loader)["input_bound"]
    assert unbounded.cost_fraction > 0.15 and unbounded.severity == "warning"
    bounded = found(tmp_path / "b", **loader, cpu_count=2, cpu_util=(46.5, 46.5, 46.5, 46.5))["input_bound"]
    assert bounded.cost_fraction == pytest.approx(0.07, abs=0.005)
    assert bounded.evidence["cost_lower_bound"] < 0.05 and bounded.severity == "info"
    # Loading on the training thread is CPU work the fix removes: it counts on top of the idle cores.
    cpu = found(tmp_path / "c", **{**loader, "data_cpu": 1.0}, cpu_count=2, cpu_util=(46.5, 46.5, 46.5, 46.5))
    assert cpu["input_bound"].cost_fraction > bounded.cost_fraction + 0.08
    # An older collector did not time the loader's CPU: the wait may be work, nothing is bounded.
    old = found(tmp_path / "d", **{**loader, "data_cpu": None}, cpu_count=2, cpu_util=(46.5, 46.5, 46.5, 46.5))
    assert old["input_bound"].cost_fraction == pytest.approx(unbounded.cost_fraction, abs=0.01)
