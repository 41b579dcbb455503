"""expert_imbalance on synthetic telemetry: the hot rank and layer, the cost by hand, and the levers offered."""

from __future__ import annotations

from pathlib import Path

import pytest

from diagnostics.diagnosis import analyse
from diagnostics.kinds.expert_imbalance import waited_for_experts
from diagnostics.recommend import recommend_all
from tests.diag_fixtures import write_run


def test_skewed_experts_name_the_rank_holding_them_with_the_cost_of_its_extra_work(tmp_path: Path) -> None:
    analysis = analyse(write_run(tmp_path / "skewed", "expert_imbalance"))
    [finding] = [f for f in analysis.findings if f.kind == "expert_imbalance"]
    ev = finding.evidence
    assert finding.ranks == [0] and ev["hot_rank"] == 0 and ev["hottest_expert"] == 0
    # Rank 0 computes experts 0-1 (0.55 + 0.15 = 70% of the load), rank 1 30%: 0.7 / 0.5 - 1 = 40% over the mean.
    assert ev["load_excess"] == pytest.approx(0.4, abs=1e-3)
    assert ev["layer_load_ratio"] == [pytest.approx(1.4, abs=1e-3)] * 2
    # By hand: experts make half the FLOPs (s = 0.5), X = 0.4: of the compute C, C s X / (1 + s X) = C / 6 is lost.
    steady = [s for r in analysis.run.ranks.values() for s in r.steps if s.step > 2]
    compute = sum(s.local_compute_s for s in steady) / len(steady)
    step = sum(s.step_s for s in steady) / len(steady)
    assert finding.cost_fraction == pytest.approx(compute / 6 / step, abs=1e-3)
    assert finding.severity == "warning"

    [recs] = [r for f, r in zip(analysis.findings, recommend_all(analysis), strict=True) if f is finding]
    overrides = [r.override for r in recs]
    assert overrides == ["model.aux_loss_coef=0.1", "model.capacity_factor=1.25"]
    # A capacity of 1.25 leaves 0.25 of the 0.4 excess: 37.5% of the cost recovered.
    assert recs[1].expected_gain["fraction"] == pytest.approx(finding.cost_fraction * 0.375, abs=1e-4)


def test_hot_experts_sharing_a_rank_are_placed_apart_with_the_whole_excess_as_gain(tmp_path: Path) -> None:
    # Experts 0 and 1 (35% each) both on rank 0 (70% of the load); placed apart, every rank computes 50%.
    analysis = analyse(write_run(tmp_path / "pair", "expert_imbalance", expert_shares=(0.35, 0.35, 0.15, 0.15)))
    [finding] = [f for f in analysis.findings if f.kind == "expert_imbalance"]
    assert finding.evidence["load_excess"] == pytest.approx(0.4, abs=1e-3)
    assert finding.evidence["balanced_placement"] == [[0, 2, 1, 3]] * 2
    assert finding.evidence["load_excess_balanced"] == pytest.approx(0.0, abs=1e-3)
    [recs] = [r for f, r in zip(analysis.findings, recommend_all(analysis), strict=True) if f is finding]
    [placed] = [r for r in recs if r.key == "strategy.expert_placement"]
    assert placed.override == "strategy.expert_placement=[[0,2,1,3],[0,2,1,3]]"
    assert placed.expected_gain["fraction"] == pytest.approx(finding.cost_fraction, abs=1e-4)  # all of the excess

    # The same loads run with that placement: every rank computes half; nothing to report.
    placed_run = write_run(
        tmp_path / "placed", "expert_imbalance", expert_shares=(0.35, 0.35, 0.15, 0.15), expert_placement=(0, 2, 1, 3)
    )
    assert [f.kind for f in analyse(placed_run).findings] == []


def test_balanced_experts_raise_nothing(tmp_path: Path) -> None:
    analysis = analyse(write_run(tmp_path / "even", "expert_imbalance", expert_shares=(0.26, 0.25, 0.25, 0.24)))
    assert analysis.findings == []


def test_report_plots_expert_load_by_rank_and_leaves_dense_runs_without_it(tmp_path: Path) -> None:
    from diagnostics.report.plots import all_plots, expert_load

    plot_id, _, svg = expert_load(analyse(write_run(tmp_path / "skewed", "expert_imbalance")))
    assert plot_id == "expert-load" and svg is not None
    # Rank 0 computes experts 0-1: 70% of every layer's assignments.
    assert "layer 0 ep rank 0: 0.7 share" in svg and "layer 1 ep rank 1: 0.3 share" in svg
    assert "expert-load" not in [p[0] for p in all_plots(analyse(write_run(tmp_path / "dense", "healthy")))]


def test_the_wait_for_the_busiest_experts_is_read_at_the_exchanges_that_end_them() -> None:
    # Two ranks, four exchanges a step; the second and fourth end the experts' compute. Rank 1 waits 3 ms there for
    # rank 0 (its experts are busier); at the others the ranks take turns waiting 1 ms (a shared host).
    calls = [[0.002, 0.001, 0.001, 0.001], [0.001, 0.004, 0.002, 0.004]]
    # Mean waits per call: 0.5, 1.5, 0.5, 1.5 ms; the exchanges before the experts wait 0.5 ms each anyway.
    assert waited_for_experts(calls, [1, 3]) == pytest.approx(2 * (0.0015 - 0.0005))
    # Balanced experts: the exchanges after them wait no more than the others: nothing lost to the experts.
    even = [[0.002, 0.001, 0.001, 0.002], [0.001, 0.002, 0.002, 0.001]]
    assert waited_for_experts(even, [1, 3]) == pytest.approx(0.0)
    # Without exchanges before the experts there is no baseline to take off.
    assert waited_for_experts([[0.001, 0.003], [0.004, 0.001]], [0, 1]) == pytest.approx(0.0015 + 0.001)


def test_where_the_exchanges_were_timed_the_cost_is_the_measured_wait_not_the_flops(tmp_path: Path) -> None:
    # moe-micro ep=2 on 2 ranks, expert 0 hot (rank 0 computes 70%); per phase 4 timed all-to-alls; at the 2nd and
    # 4th (after the experts) rank 1 waits 3 ms for rank 0.
    timed = {
        "sync_in_phases": True, "phase_calls": 5, "all_to_all": True, "comm_ops": ("gloo:all_to_all",),
        "after_experts": (1, 3, 6, 8), "after_experts_skew": 0.003,
    }  # fmt: skip
    analysis = analyse(write_run(tmp_path / "timed", "expert_imbalance", **timed))
    [finding] = [f for f in analysis.findings if f.kind == "expert_imbalance"]
    assert finding.evidence["cost_from"] == "waits"
    # Each phase's fifth call (its end, where the ranks' compute noise meets) waits too: that is the baseline.
    steady = [(a, b) for a, b in zip(*(r.steps for r in analysis.run.ranks.values()), strict=True) if a.step > 2]
    after = [sum((x + y) / 2 - min(x, y) for i, (x, y) in enumerate(zip(a.all_to_all_calls_s, b.all_to_all_calls_s,
             strict=True)) if i in (1, 3, 6, 8)) for a, b in steady]  # fmt: skip
    assert after == [pytest.approx(4 * 0.0015)] * len(steady)  # 1.5 ms at each exchange after the experts
    expected = sum(waited_for_experts([a.all_to_all_calls_s, b.all_to_all_calls_s], [1, 3, 6, 8]) for a, b in steady)
    lost = finding.evidence["lost_s_per_step"]
    assert lost == pytest.approx(expected / len(steady), abs=2e-6) and 0 < lost < 4 * 0.0015
    step = finding.evidence["lost_s_per_step"] / finding.cost_fraction
    steady = [s.step_s for r in analysis.run.ranks.values() for s in r.steps if s.step > 2]
    assert min(steady) <= step <= max(steady)
    # The same run recorded without the positions (older collectors): the FLOP estimate, as before.
    untimed = {k: v for k, v in timed.items() if k != "after_experts"}
    [old] = [f for f in analyse(write_run(tmp_path / "untimed", "expert_imbalance", **untimed)).findings if
             f.kind == "expert_imbalance"]  # fmt: skip
    assert old.evidence["cost_from"] == "flops"


def test_a_straggler_that_is_the_rank_holding_the_hot_experts_is_the_imbalance_not_another_finding() -> None:
    from diagnostics.analysis.finding import Finding, cost
    from diagnostics.diagnosis import explained_by_experts

    def finding(kind: str, ranks: list[int], fraction: float) -> Finding:
        return Finding(kind, "warning", ranks, {}, kind, cost=cost(fraction, "test"))

    hot = finding("expert_imbalance", [0], 0.16)
    [kept] = explained_by_experts([finding("straggler", [0], 0.29)], [hot])
    assert kept.kind == "expert_imbalance" and kept.evidence["explains_straggler"] == 0.29
    # A straggler elsewhere (another rank) is its own cause.
    other = explained_by_experts([finding("straggler", [1], 0.2)], [hot])
    assert [f.kind for f in other] == ["straggler", "expert_imbalance"]
    assert "explains_straggler" not in other[1].evidence
