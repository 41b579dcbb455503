"""Expert parallelism on real gloo ranks: the built-in MoE model under strategy.ep trains what one process trains.

One single-process reference and one ``ep=2`` run on 2 ranks (dropless, 20 steps); the same ``ep=2`` launch also
carries the expert-load counters into the per-rank telemetry, checked here against what routing must add up to,
and the all-to-alls timed as the phases' communication. Their step-10 checkpoints resume at the other ep
(2 -> 1 and one process -> 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist.test_parity_and_resume import STEPS, run, train_losses

pytestmark = pytest.mark.dist

COMMON = [
    "model=moe-micro",
    "data.num_train_tokens=32768",
    "data.num_val_tokens=4096",
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.val_every_n_steps=1000",
    "trainer.val_batches=1",
    "trainer.ckpt_every_n_steps=10",  # the ep=2 and one-process runs write step 10, resumed at the other ep
    "optimizer.warmup_steps=2",
    "optimizer.lr=1e-3",
    "precision=fp32",
]
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("moe-reference")
    args = [*COMMON, "hw.devices_per_node=1", f"trainer.micro_batch_size={GLOBAL_BATCH}", "diagnostics=off"]
    return run(tmp, "single", args)


@pytest.fixture(scope="module")
def reference(reference_run: Path) -> dict[int, float]:
    return train_losses(reference_run)


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("moe-ep2")
    return run(tmp, "ep2", [*COMMON, "strategy=fsdp", "strategy.ep=2", "trainer.micro_batch_size=4"])


def expert_records(run_dir: Path, rank: int) -> list[dict]:
    lines = (run_dir / "telemetry" / f"rank{rank:04d}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "experts"]


def test_expert_parallel_matches_one_process_and_counts_every_routed_token(
    reference: dict[int, float], ep2_run: Path
) -> None:
    run_dir = ep2_run
    losses = train_losses(run_dir)
    assert sorted(losses) == sorted(reference) == list(range(STEPS))
    worst = max(abs(losses[s] - reference[s]) for s in reference)
    assert worst < 1e-4, f"ep=2 drifts from one process by {worst:.2e}"

    # Every step, each rank counts its own tokens' routing: 4 sequences x 64 tokens x top-2, per layer.
    for rank in (0, 1):
        records = expert_records(run_dir, rank)
        steps = [r["step"] for r in records]
        assert len(steps) == STEPS and steps == sorted(set(steps))  # one record per optimizer step
        for r in records:
            assert [sum(layer) for layer in r["routed"]] == [4 * 64 * 2] * 2
            assert r["dropped"] == [[0] * 4] * 2  # dropless
    layout = [r for r in map(json.loads, (run_dir / "telemetry" / "rank0001.jsonl").read_text().splitlines())]
    layout = [r for r in layout if r.get("kind") == "expert_layout"]
    assert layout and layout[0]["ep"] == 2 and layout[0]["first_expert"] == 2 and layout[0]["num_local"] == 2

    # The all-to-alls are timed as the phases' communication: per micro-batch and layer, forward exchanges the
    # counts, dispatches and combines, backward reverses the two token exchanges (2 layers: 6 + 4 calls per step).
    for rank in (0, 1):
        steps = step_records(run_dir, rank)
        assert len(steps) == STEPS - 1  # the first step has no previous end to be timed from
        for s in steps:
            assert s["forward_comm_s"] > 0 and s["backward_comm_s"] > 0
            # Those ending the experts' compute: each layer's combine forward, its dispatch's reverse in backward.
            assert s["all_to_all_after_experts"] == [2, 5, 7, 9]
            assert len(s["all_to_all_calls_s"]) == 10 and s["all_to_all_s"] == pytest.approx(
                sum(s["all_to_all_calls_s"]), abs=1e-5
            )
            # Within the phases' collectives (FSDP2's, the balancing all-reduces, the all-to-alls), call by call.
            assert s["all_to_all_s"] <= s["forward_comm_s"] + s["backward_comm_s"] + 1e-9
            assert sum(s["comm_calls_s"]) == pytest.approx(s["forward_comm_s"] + s["backward_comm_s"], abs=1e-4)
    exchange = json.loads((run_dir / "report" / "report.json").read_text())["summary"]["all_to_all"]
    assert 0 < exchange["transfer"] <= exchange["share"] < 1


def step_records(run_dir: Path, rank: int) -> list[dict]:
    lines = (run_dir / "telemetry" / f"rank{rank:04d}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "step"]


# Each group's rank 0 holds experts {3, 1} of layer 0 and {2, 0} of layer 1: not contiguous, not in id order.
PLACEMENT = [[3, 1, 0, 2], [2, 0, 3, 1]]


@pytest.fixture(scope="module")
def placed_ep2x4_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("moe-ep2x4-placed")
    placement = "strategy.expert_placement=" + str(PLACEMENT).replace(" ", "")
    args = [*COMMON, "strategy=fsdp", "strategy.ep=2", placement, "hw.devices_per_node=4", "trainer.micro_batch_size=2"]
    return run(tmp, "ep2x4", args)


def test_expert_parallel_composes_with_fsdp_over_four_ranks_and_any_placement(
    reference: dict[int, float], placed_ep2x4_run: Path
) -> None:
    """ep=2 x 2 expert-data-parallel groups: experts FSDP-sharded over 2 ranks, dense parts over 4, the experts
    placed out of order on the group's ranks: the same training, and the load counters keep the experts' ids."""
    losses = train_losses(placed_ep2x4_run)
    worst = max(abs(losses[s] - reference[s]) for s in reference)
    assert worst < 1e-4, f"placed ep=2 x fsdp on 4 ranks drifts from one process by {worst:.2e}"
    records = [r for r in map(json.loads, (placed_ep2x4_run / "telemetry" / "rank0003.jsonl").read_text().splitlines())]
    (layout,) = [r for r in records if r.get("kind") == "expert_layout"]
    assert layout["placement"] == PLACEMENT and (layout["first_expert"], layout["num_local"]) == (2, 2)
    # Counted by expert id on the routing side: the counts of the first step are the one-process model's, which
    # routes the same tokens with the same router (one process counts all 8 sequences; each rank 2 of them).
    first = [expert_records(placed_ep2x4_run, rank)[0]["routed"] for rank in range(4)]
    summed = [[sum(rank[layer][e] for rank in first) for e in range(4)] for layer in range(2)]
    assert [sum(layer) for layer in summed] == [8 * 64 * 2] * 2


def test_checkpoints_resume_across_ep_sizes_and_placements(
    reference_run: Path, ep2_run: Path, placed_ep2x4_run: Path, tmp_path: Path
) -> None:
    """Step-10 checkpoints resume at another ep and placement: the ep=2 run's at ep=1 (FSDP2 on 2 ranks), the placed
    ep=2 x 4 ranks run's in one process, the one-process run's at ep=2 with a placement: each holds every expert
    under its one-process name and shape, and each continues the one-process losses."""
    reference = train_losses(reference_run)
    placed = ["strategy=fsdp", "strategy.ep=2", "strategy.expert_placement=[[1,2,3,0]]", "trainer.micro_batch_size=4"]
    one_process = ["strategy=fsdp", "strategy.ep=1", "strategy.expert_placement=null"]  # the writer's were ep=2, placed
    resumes = {
        "ep2-to-ep1": (ep2_run, ["strategy=fsdp", "strategy.ep=1", "trainer.micro_batch_size=4"], 2),
        "placed-ep2x4-to-single": (placed_ep2x4_run, [*one_process, f"trainer.micro_batch_size={GLOBAL_BATCH}"], 1),
        "single-to-placed-ep2": (reference_run, placed, 2),
    }
    for name, (source, layout, ranks) in resumes.items():
        checkpoint = source / "checkpoints" / "step000010.ckpt"
        args = [*COMMON, f"resume={checkpoint}", *layout, f"hw.devices_per_node={ranks}", "diagnostics=off"]
        losses = train_losses(run(tmp_path, name, args))
        assert sorted(losses) == list(range(10, STEPS)), name
        worst = max(abs(losses[s] - reference[s]) for s in losses)
        assert worst < 1e-4, f"{name} drifts from one process by {worst:.2e}"


HF_COMMON = [*(a for a in COMMON if not a.startswith(("model=", "trainer.ckpt_every"))), "model=hf-tiny-mixtral"]


def test_hf_mixtral_under_expert_parallel_trains_and_exports_what_one_process_does(tmp_path: Path) -> None:
    """transformers' Mixtral (fused experts, HF's balancing loss on) at ep=2 on 2 ranks vs one process: the same
    losses, the same exported model, and the expert counters and layout of its own kind."""
    single = run(
        tmp_path, "hf-single", [*HF_COMMON, "hw.devices_per_node=1", "trainer.micro_batch_size=8", "diagnostics=off"]
    )
    # Placed out of order (one permutation for both layers): the export still holds every expert under its own id.
    placed = "strategy.expert_placement=[[2,0,3,1]]"
    ep2 = run(tmp_path, "hf-ep2", [*HF_COMMON, "strategy=fsdp", "strategy.ep=2", placed, "trainer.micro_batch_size=4"])
    reference, losses = train_losses(single), train_losses(ep2)
    assert sorted(losses) == sorted(reference) == list(range(STEPS))
    worst = max(abs(losses[s] - reference[s]) for s in reference)
    assert worst < 1e-4, f"HF Mixtral at ep=2 drifts from one process by {worst:.2e}"

    from safetensors.torch import load_file

    exported, expected = (load_file(str(d / "hf_model" / "model.safetensors")) for d in (ep2, single))
    assert exported.keys() == expected.keys() and any(".experts.3." in k for k in exported)  # every expert, once
    for name, tensor in expected.items():
        assert tensor.shape == exported[name].shape, name
        assert (tensor - exported[name]).abs().max() < 1e-4, name

    for rank in (0, 1):
        for r in expert_records(ep2, rank):
            assert [sum(layer) for layer in r["routed"]] == [4 * 64 * 2] * 2  # 4 sequences x 64 tokens x top-2
    lines = (ep2 / "telemetry" / "rank0001.jsonl").read_text().splitlines()
    (layout,) = [r for r in map(json.loads, lines) if r.get("kind") == "expert_layout"]
    assert (layout["ep"], layout["first_expert"], layout["num_local"]) == (2, 2, 2)
    assert layout["placement"] == [[2, 0, 3, 1]] * 2
    assert layout["aux_loss_key"] == "model.config.router_aux_loss_coef" and layout["aux_loss_coef"] == 0.02
    assert layout["capacity_key"] is None


def test_megatron_tensor_and_pipeline_parallel_moe_matches_one_process(
    reference: dict[int, float], tmp_path: Path
) -> None:
    """strategy=megatron tp=2 x pp=2 on 4 ranks: each stage holds one MoE layer, whose experts its two tp ranks split
    (each computing half of them on every token, outputs summed over the pair); the balancing loss's gradient rides
    on the layer's output through the pipeline schedule. One pipeline micro-batch: the reference's batching."""
    args = [*COMMON, "strategy=megatron", "strategy.tp=2", "strategy.pp=2", "strategy.schedule=gpipe"]
    args += ["strategy.microbatches=1", "hw.devices_per_node=4", "trainer.micro_batch_size=8", "diagnostics=off"]
    losses = train_losses(run(tmp_path, "tp2pp2", args))
    assert sorted(losses) == list(range(STEPS))
    worst = max(abs(losses[s] - reference[s]) for s in reference)
    assert worst < 1e-4, f"megatron tp=2 x pp=2 drifts from one process by {worst:.2e}"
