"""Collectives timed inside forward and backward, call by call: transfer is what every rank pays, the rest waiting.

Fixture ``moe_waits`` (tests/diag_fixtures): moe-micro under ep=2, balanced experts, 5 all-to-alls per phase each
moving ``comm / 4 / 5`` (the last one ``comm / 4``), and at the first four of them one rank arrives 60 ms late,
the ranks in turn, as a shared host's scheduler makes them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from diagnostics.analysis.comm_split import collective_kind
from diagnostics.analysis.context import RunContext
from diagnostics.analysis.phase_comm import call_minimum
from diagnostics.diagnosis import analyse
from diagnostics.kinds.comm_bound import zero2_lever
from diagnostics.recommend import recommend_all
from tests.diag_fixtures import SCENARIOS, write_run

SKEW, CALLS = SCENARIOS["moe_waits"].call_skew, SCENARIOS["moe_waits"].phase_calls
COMM = SCENARIOS["moe_waits"].comm


def test_call_minimum_sums_each_calls_fastest_rank_and_refuses_unmatched_calls() -> None:
    # Rank 0 waits at the first call, rank 1 at the second: 1 + 2 ms of transfer, not min(6, 7) = 6.
    assert call_minimum([[0.005, 0.002], [0.001, 0.006]]) == pytest.approx(0.003)
    assert call_minimum([[0.005, 0.002], [0.001]]) is None  # the ranks did not record the same calls
    assert call_minimum([]) is None


def _kinds(run_dir: Path) -> list[str]:
    return [f.kind for f in analyse(run_dir).findings]


def test_balanced_moe_whose_ranks_take_turns_waiting_is_waiting_not_comm_bound(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "waits", "moe_waits")
    analysis = analyse(run_dir)
    assert "comm_bound" not in [f.kind for f in analysis.findings]
    steady = [s for s in analysis.run.ranks[0].steps if s.step > 2]
    step_s = sum(max(r.steps[s.step - 1].step_s for r in analysis.run.ranks.values()) for s in steady) / len(steady)
    # By hand: per phase, four small calls of COMM / 4 / CALLS and the last of COMM / 4 (its minimum has no wait).
    transfer = 2 * ((CALLS - 1) * COMM / 4 / CALLS + COMM / 4)
    exchange = analysis.summary.all_to_all
    assert exchange is not None
    assert exchange["transfer"] == pytest.approx(transfer / step_s, abs=1e-3)
    # Each rank waits at two of the four skewed calls per phase: 4 x 60 ms per step, beside 18 ms of transfer.
    for p in analysis.phases:
        assert p.collective_wait_s == pytest.approx(4 * SKEW, abs=0.005)
    assert exchange["waiting"] == pytest.approx(4 * SKEW / step_s, abs=0.01)
    shares = analysis.summary.step_shares
    assert shares is not None and shares["waiting"] > 5 * shares["communication"]

    # The same run with each rank's per-step sums only: both sums hold the same waits, so their minimum does too,
    # and the waits read as communication. Call by call is what separates them.
    for path in (run_dir / "telemetry").glob("*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        for r in records:
            r.pop("comm_calls_s", None)
            r.pop("all_to_all_calls_s", None)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "comm_bound" in _kinds(run_dir)


def test_rank_holding_the_hot_experts_makes_its_peer_wait_in_the_all_to_alls(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "hot", "moe_waits", late_rank=0, expert_shares=(0.55, 0.15, 0.15, 0.15))
    analysis = analyse(run_dir)
    kinds = {f.kind: f for f in analysis.findings}
    assert "comm_bound" not in kinds
    assert kinds["expert_imbalance"].ranks == [0]
    waits = {p.rank: p.collective_wait_s for p in analysis.phases}
    # Rank 0 arrives last at every skewed call (4 per phase): rank 1 waits 8 x 60 ms, rank 0 not at all.
    assert waits[1] == pytest.approx(8 * SKEW, abs=0.005) and waits[0] == pytest.approx(0.0, abs=0.005)
    exchange = analysis.summary.all_to_all
    assert exchange is not None and exchange["waiting"] > 10 * exchange["transfer"]


def test_runs_without_expert_all_to_alls_have_no_all_to_all_share(tmp_path: Path) -> None:
    assert analyse(write_run(tmp_path / "fsdp", "healthy", sync_in_phases=True)).summary.all_to_all is None


def test_comm_bound_by_token_all_to_alls_names_them_and_offers_no_accumulation(tmp_path: Path) -> None:
    """Expert all-to-alls move every micro-batch's tokens: more accumulation moves as many per token (it only
    amortizes gradient reductions), so the lever is fewer ranks per expert group, not a bigger batch."""
    analysis = analyse(write_run(tmp_path / "tokens", "moe_comm_bound"))
    found = {f.kind: (f, recs) for f, recs in zip(analysis.findings, recommend_all(analysis), strict=True)}
    finding, recs = found["comm_bound"]
    assert "moving tokens between expert-parallel ranks (all-to-all" in finding.message
    assert finding.evidence["all_to_all"]["of_phase_transfer"] == pytest.approx(1.0)
    keys = [r.key for r in recs]
    assert "strategy.ep" in keys and "trainer.global_batch_size" not in keys
    assert next(r for r in recs if r.key == "strategy.ep").value == "1"
    # A dense DDP run bound by its gradients: one all-reduce per optimizer step, so accumulation halves it per token.
    dense = analyse(write_run(tmp_path / "dense", "comm_bound", overrides=("strategy=ddp",)))
    dense_found = {f.kind: (f, r) for f, r in zip(dense.findings, recommend_all(dense), strict=True)}
    dense_finding, dense_recs = dense_found["comm_bound"]
    assert "moving gradients" in dense_finding.message and "all_to_all" not in dense_finding.evidence
    assert dense_finding.evidence["comm_split"]["once_per_step"] == 1.0
    (bigger,) = [r for r in dense_recs if r.key == "trainer.global_batch_size"]
    assert bigger.expected_gain is not None
    assert bigger.expected_gain["fraction"] == pytest.approx(0.5 * dense_finding.cost_fraction, abs=1e-3)


def test_fsdp_gathers_and_reduces_every_micro_batch_so_accumulation_is_not_offered(tmp_path: Path) -> None:
    """Lightning's FSDP2 strategy pauses no gradient sync while accumulating: measured on the default model, 2 CPU
    ranks, its communication per step went from 52-72 ms to 99-116 ms at accumulation 2 (8% of the step both ways,
    tokens/s +1.5..+3%). A bigger global batch would save none of it."""
    run = analyse(write_run(tmp_path / "fsdp", "comm_bound", overrides=("strategy=fsdp",)))
    found = {f.kind: (f, r) for f, r in zip(run.findings, recommend_all(run), strict=True)}
    finding, recs = found["comm_bound"]
    assert finding.evidence["comm_split"]["once_per_step"] == 0.0
    assert "trainer.global_batch_size" not in [r.key for r in recs]


def test_a_half_precision_reduce_scatter_is_worth_half_of_the_gradients_share_only(tmp_path: Path) -> None:
    """FSDP under bf16-mixed gathers bf16 weights twice per micro-batch (2 + 2 bytes) and reduce-scatters fp32
    gradients (4): the reduction is half of the bytes, so reduce_dtype=bf16 saves a quarter, not half."""
    overrides = ("strategy=fsdp", "precision=bf16-mixed", "strategy.reduce_dtype=fp32")
    run = analyse(write_run(tmp_path / "fsdp", "comm_bound", overrides=overrides))
    found = {f.kind: (f, r) for f, r in zip(run.findings, recommend_all(run), strict=True)}
    finding, recs = found["comm_bound"]
    assert finding.evidence["comm_split"]["gradient_reduction"] == pytest.approx(0.5)
    (bf16,) = [r for r in recs if r.key == "strategy.reduce_dtype"]
    assert bf16.expected_gain["fraction"] == pytest.approx(0.25 * finding.cost_fraction, abs=1e-3)


def test_fsdps_gradient_share_is_the_profiled_collectives_own_and_prices_keeping_the_gathered_weights(
    tmp_path: Path,
) -> None:
    """Where the profiler timed FSDP's all-gathers and reductions (backend ops; the FSDP:: annotations around them
    do not count twice), their times split the communication, not the planner's link probe: here 2 parts
    gathering to 1 reducing. ``reshard_after_forward=false`` removes backward's half of the gathers. Measured on a
    3-rank run (2 layers, width 32, 2 cores): expected 9% of the step, --ab +12.1% tokens/s (+1.3..+24.1%)."""
    ops = ("gloo:all_gather", "nccl:all_gather_into_tensor_coalesced", "gloo:reduce_scatter", "FSDP::all_gather ")
    run = analyse(write_run(tmp_path / "fsdp", "comm_bound", overrides=("strategy=fsdp",), comm_ops=ops))
    found = {f.kind: (f, r) for f, r in zip(run.findings, recommend_all(run), strict=True)}
    finding, recs = found["comm_bound"]
    assert finding.evidence["comm_split"]["gradient_reduction"] == pytest.approx(1 / 3, abs=1e-4)
    assert "profiled" in finding.evidence["comm_split"]["basis"]
    (keep,) = [r for r in recs if r.key == "strategy.reshard_after_forward"]
    assert keep.expected_gain["fraction"] == pytest.approx(0.5 * (2 / 3) * finding.cost_fraction, abs=1e-3)


def test_zero3_comm_bound_offers_zero2_costed_on_the_gathers_it_keeps_once_per_step(tmp_path: Path) -> None:
    """ZeRO-3 gathers parameters every micro-batch (forward and backward); ZeRO-2 gathers the updated ones once per
    step: at one micro-batch per step it keeps half the gathers' bytes. Here 2 parts gathering to 1 reducing."""
    ops = ("gloo:all_gather", "nccl:all_gather_into_tensor_coalesced", "gloo:all_reduce", "c10d::_allgather_base_")
    overrides = ("strategy=deepspeed", "strategy.stage=3")
    run = analyse(write_run(tmp_path / "zero3", "comm_bound", overrides=overrides, comm_ops=ops))
    found = {f.kind: (f, r) for f, r in zip(run.findings, recommend_all(run), strict=True)}
    finding, recs = found["comm_bound"]
    assert finding.evidence["comm_split"]["gradient_reduction"] == pytest.approx(1 / 3, abs=1e-4)
    (zero2,) = [r for r in recs if r.key == "strategy.stage"]
    assert zero2.value == "2"
    assert zero2.expected_gain["fraction"] == pytest.approx((2 / 3) * 0.5 * finding.cost_fraction, abs=1e-3)
    stage2 = analyse(write_run(tmp_path / "zero2", "comm_bound", overrides=("strategy=deepspeed",), comm_ops=ops))
    assert not [r for rs in recommend_all(stage2) for r in rs if r.key == "strategy.stage"]
    # On devices whose measured headroom cannot hold whole parameters (why ZeRO-3 is often chosen), not offered.
    ctx = RunContext.from_run(run.run)
    fits = {**finding.evidence, "device_headroom_bytes": 40 * 2**30, "num_parameters": 7_000_000_000}
    full = {**fits, "device_headroom_bytes": 4 * 2**30}
    split = finding.evidence["comm_split"]
    assert zero2_lever(dataclasses.replace(finding, evidence=fits), ctx, split, 0.0)
    assert zero2_lever(dataclasses.replace(finding, evidence=full), ctx, split, 0.0) == []


def test_collectives_are_told_by_backend_op_and_annotations_are_not() -> None:
    kinds = {
        "gloo:all_gather": "gather",
        "gloo:all_reduce": "reduce",
        "ncclDevKernel_AllGather_RING_LL": "gather",
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL": "reduce",
        "FSDP::all_gather": None,
        "FSDP::post_backward_reduce": None,
        "_c10d_functional::wait_tensor": None,
        "gloo:send": None,
    }
    assert {op: collective_kind(op) for op in kinds} == kinds


def test_the_planners_split_of_the_runs_own_traffic_sets_what_accumulation_can_save(tmp_path: Path) -> None:
    """run.json's prediction says which share of the layout's traffic moves once per step (here 60%): accumulation
    is worth half of that share of the cost; below AMORTIZED_MIN it is not offered."""
    for once, offered in ((0.6, True), (0.1, False)):
        run_dir = write_run(tmp_path / f"once{once}", "comm_bound", overrides=("strategy=deepspeed",))
        manifest = json.loads((run_dir / "run.json").read_text())
        manifest["prediction"] = {"predicted": {"comm_shares": {"once_per_step": once, "tensor_parallel": 0.0}}}
        (run_dir / "run.json").write_text(json.dumps(manifest))
        run = analyse(run_dir)
        found = {f.kind: (f, r) for f, r in zip(run.findings, recommend_all(run), strict=True)}
        finding, recs = found["comm_bound"]
        assert "the planner" in finding.evidence["comm_split"]["basis"]
        bigger = [r for r in recs if r.key == "trainer.global_batch_size"]
        assert bool(bigger) == offered
        if offered:
            assert bigger[0].expected_gain["fraction"] == pytest.approx(0.5 * once * finding.cost_fraction, abs=1e-3)


def test_all_to_alls_a_material_minority_offer_fewer_ranks_per_expert_group_and_accumulation_where_it_pays(
    tmp_path: Path,
) -> None:
    """moe-micro under FSDP, ep=2, on 2 CPU ranks: all-to-alls 14-15% of the step, 40% of the phases' transfer,
    and ep=1 measured faster than ep=2 by more than that: fewer ranks per expert group is offered, worth the
    all-to-alls' share. FSDP gathers and reduces every micro-batch, so accumulation is not; where most of the traffic
    moves once per step (the prediction says so), accumulation is offered on that part, less the all-to-alls."""
    analysis = analyse(write_run(tmp_path / "mixed", "moe_comm_bound", all_to_all_share=0.4))
    found = {f.kind: (f, recs) for f, recs in zip(analysis.findings, recommend_all(analysis), strict=True)}
    finding, recs = found["comm_bound"]
    exchange = finding.evidence["all_to_all"]
    assert exchange["of_phase_transfer"] == pytest.approx(0.4, abs=0.02)
    assert "moving gradients" in finding.message
    by_key = {r.key: r for r in recs}
    ep = by_key["strategy.ep"]
    assert ep.value == "1"
    assert ep.expected_gain["fraction"] == pytest.approx(min(finding.cost_fraction, exchange["share"]), abs=1e-3)
    assert "trainer.global_batch_size" not in by_key
    run_dir = write_run(tmp_path / "once", "moe_comm_bound", all_to_all_share=0.4)
    manifest = json.loads((run_dir / "run.json").read_text())
    manifest["prediction"] = {"predicted": {"comm_shares": {"once_per_step": 0.9, "tensor_parallel": 0.0}}}
    (run_dir / "run.json").write_text(json.dumps(manifest))
    once = analyse(run_dir)
    found = {f.kind: (f, r) for f, r in zip(once.findings, recommend_all(once), strict=True)}
    once_finding, once_recs = found["comm_bound"]
    bigger = {r.key: r for r in once_recs}["trainer.global_batch_size"]
    tokens = once_finding.evidence["all_to_all"]["of_phase_transfer"]
    assert bigger.expected_gain["fraction"] == pytest.approx(0.5 * (1 - tokens) * once_finding.cost_fraction, abs=1e-3)
    # All-to-alls under the material share: no expert-group lever.
    small = analyse(write_run(tmp_path / "small", "moe_comm_bound", all_to_all_share=0.05))
    small_recs = dict(zip([f.kind for f in small.findings], recommend_all(small), strict=True))["comm_bound"]
    assert small.summary.all_to_all is not None and small.summary.all_to_all["share"] < 0.05
    assert "strategy.ep" not in [r.key for r in small_recs]
