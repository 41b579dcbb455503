"""strategy.expert_placement: which experts each rank of an expert-parallel group holds.

The routing side (a placed layer computes what the contiguous one does), the checkpoint layout (placed rows tile
the one-process tensor once, for FSDP2's dim-0 and dim-1 splits), the refusals, and the balanced placement the
report proposes, checked against brute force on generated loads."""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Iterator

import pytest
import torch

from diagnostics.analysis.expert_placement import as_placement, balance_layer, balanced_placement, busiest, excess
from disttrain.config.errors import ConfigError
from disttrain.config.parse import parse_run_config
from disttrain.models.moe import moe_layers
from disttrain.models.transformer import build_model
from disttrain.strategies.expert_checkpoint import placed_layout
from disttrain.strategies.layout import validate_run
from tests.conftest import compose_train, model_preset


def test_a_placed_layer_computes_what_the_contiguous_one_does() -> None:
    """Slots reorder the exchange and the stacked rows, never the function: same outputs and gradients (by expert)."""
    torch.manual_seed(0)
    plain = build_model(model_preset("moe-micro"), seed=1)
    placed = copy.deepcopy(plain)
    order = [2, 0, 3, 1]
    for layer in moe_layers(placed):
        layer.place(order)
        layer.keep_experts(slice(0, 4), 1.0)  # one rank holding every slot: rows in slot order
    assert moe_layers(placed)[0].held_ids == order
    assert torch.equal(moe_layers(placed)[1].experts.w1, moe_layers(plain)[1].experts.w1[order])
    tokens = torch.randint(0, 256, (2, 64))
    outs = []
    for model in (plain, placed):
        logits = model(tokens)
        logits.float().square().mean().backward()
        outs.append(logits)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-5)
    for a, b in zip(moe_layers(plain), moe_layers(placed), strict=True):
        torch.testing.assert_close(b.experts.w2.grad, a.experts.w2.grad[order], atol=1e-7, rtol=1e-5)
        torch.testing.assert_close(b.router.weight.grad, a.router.weight.grad, atol=1e-7, rtol=1e-5)
        assert torch.equal(a.tokens_per_expert, b.tokens_per_expert)  # counted by expert id, not slot


@pytest.mark.parametrize(
    ("world", "ep", "experts", "fsdp_dim"), [(2, 2, 4, 0), (4, 2, 4, 0), (4, 2, 2, 1), (8, 4, 8, 0)]
)
def test_placed_rows_tile_the_one_process_tensor_once(world: int, ep: int, experts: int, fsdp_dim: int) -> None:
    rng = random.Random(world * 100 + experts)
    placement = rng.sample(range(experts), experts)
    local = experts // ep
    shape = torch.Size((local, 6, 4))
    layout = placed_layout(shape, fsdp_dim, ep, placement, world)
    covered = torch.zeros(experts, 6, 4, dtype=torch.int64)
    for holder, pieces in layout.items():
        for _, meta in pieces:
            index = tuple(slice(o, o + n) for o, n in zip(meta.shard_offsets, meta.shard_sizes, strict=True))
            covered[index] += 1
            assert meta.placement.rank() == holder
        group_slots = range((holder % ep) * local, (holder % ep + 1) * local)
        assert {m.shard_offsets[0] for _, m in pieces} <= {placement[s] for s in group_slots}
    assert covered.eq(1).all()


def refused(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        validate_run(parse_run_config(compose_train(["model=moe-micro", "strategy=fsdp", *overrides])))
    return err.value


@pytest.mark.parametrize(
    ("overrides", "fix"),
    [
        (["strategy.expert_placement=[[1,0,2,3]]"], "strategy.ep to a degree > 1"),
        (["strategy.ep=2", "strategy.expert_placement=[[1,0,2,3],[0,1,2,3],[3,2,1,0]]"], "per MoE layer (2)"),
        (["strategy.ep=2", "strategy.expert_placement=[[1,0,2,2]]"], "0..3 exactly once"),
        (["strategy.ep=2", "strategy.expert_placement=[[0,1,2]]"], "[k*2, (k+1)*2)"),
    ],
)
def test_impossible_placements_are_refused_with_key_and_fix(overrides: list[str], fix: str) -> None:
    err = refused(["hw.devices_per_node=2", *overrides])
    assert err.key == "strategy.expert_placement" and fix in str(err)


def test_a_placement_per_layer_or_one_for_all_is_accepted() -> None:
    for placement in ("[[3,1,0,2],[2,0,3,1]]", "[[1,2,3,0]]"):
        overrides = ["model=moe-micro", "strategy=fsdp", "strategy.ep=2", "hw.devices_per_node=2"]
        cfg = parse_run_config(compose_train([*overrides, f"strategy.expert_placement={placement}"]))
        validate_run(cfg)
        assert cfg.strategy.expert_placement == eval(placement)


def _even_splits(experts: list[int], local: int) -> Iterator[list[list[int]]]:
    """Every split of ``experts`` into groups of ``local`` (unordered): the first expert's group, then the rest."""
    if not experts:
        yield []
        return
    first, rest = experts[0], experts[1:]
    for partners in itertools.combinations(rest, local - 1):
        remaining = [e for e in rest if e not in partners]
        for split in _even_splits(remaining, local):
            yield [[first, *partners], *split]


def _optimum(loads: list[int], ep: int) -> int:
    """The smallest busiest-rank load over every even split (brute force)."""
    return min(busiest(loads, split) for split in _even_splits(list(range(len(loads))), len(loads) // ep))


@pytest.mark.parametrize("seed", range(12))
def test_balanced_placement_is_even_never_worse_and_near_the_optimum(seed: int) -> None:
    rng = random.Random(seed)
    ep = rng.choice([2, 4])
    experts = ep * rng.choice([1, 2, 3]) if ep == 4 else ep * rng.choice([2, 3, 4])
    # Skewed loads as routers produce them: a few hot experts over a cold tail.
    loads = [int(rng.paretovariate(1.2) * 1000) for _ in range(experts)]
    held = balance_layer(loads, ep)
    assert sorted(e for rank in held for e in rank) == list(range(experts))
    assert all(len(rank) == experts // ep for rank in held)
    contiguous = [list(range(j * experts // ep, (j + 1) * experts // ep)) for j in range(ep)]
    assert busiest(loads, held) <= busiest(loads, contiguous)
    # LPT with swaps: within the heaviest expert's load of the best even split (exact on most draws).
    assert busiest(loads, held) <= _optimum(loads, ep) + max(loads) / 2


def test_balanced_placement_keeps_layers_that_cannot_gain_and_reports_the_excess_left() -> None:
    # Layer 0: one expert carries half the load: no placement helps. Layer 1: the two hot experts share rank 0.
    per_expert = [[500, 150, 150, 150], [350, 350, 150, 150]]
    current = [[[0, 1], [2, 3]]] * 2
    balanced = balanced_placement(per_expert, current)
    assert balanced[0] == current[0] and balanced[1] == [[0, 2], [1, 3]]
    assert as_placement(balanced) == [[0, 1, 2, 3], [0, 2, 1, 3]]
    assert excess(per_expert, current) == pytest.approx((650 - 475 + 700 - 500) / (475 + 500))
    assert excess(per_expert, balanced) == pytest.approx((650 - 475) / (475 + 500))
