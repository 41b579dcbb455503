"""The mixture-of-experts layer and model: routing, balancing losses, capacity, init, accounting, config checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disttrain.config.errors import ConfigError
from disttrain.config.experts import validate_expert_parallel
from disttrain.config.parse import parse_run_config
from disttrain.config.schema import ModelConfig
from disttrain.models.accounting import count_active_parameters, count_parameters, flops_per_token, matmul_parameters
from disttrain.models.expert_exchange import regroup
from disttrain.models.moe import MoE, auxiliary_loss, moe_layers
from disttrain.models.transformer import apply_activation_checkpointing, build_model
from disttrain.strategies.layout import validate_run
from tests.conftest import compose_train, model_preset

MOE = ModelConfig(
    name="moe-test",
    n_layers=2,
    d_model=16,
    n_heads=2,
    ffn_hidden=32,
    vocab_size=40,
    seq_len=8,
    norm="rmsnorm",
    mlp="swiglu",
    pos_emb="rope",
    bias=False,
    num_experts=4,
    top_k=2,
    expert_ffn_hidden=8,
    num_shared_experts=1,
)


def test_model_counts_total_and_active_parameters() -> None:
    model = build_model(MOE, seed=0)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(MOE)
    expert = 3 * 16 * 8  # w1, w3 [d, h] and w2 [h, d] of one expert
    assert count_parameters(MOE) - count_active_parameters(MOE) == MOE.n_layers * 2 * expert  # 2 of 4 idle
    # FLOPs count what a token multiplies with: the router, top_k experts and the shared expert.
    dense_equivalent = dataclasses.replace(MOE, num_experts=0, num_shared_experts=0, ffn_hidden=8 * 3)
    router = MOE.n_layers * 16 * 4
    assert matmul_parameters(MOE) == matmul_parameters(dense_equivalent) + router
    assert flops_per_token(MOE) == flops_per_token(dense_equivalent) + 6 * router


@pytest.mark.parametrize(
    ("preset", "total", "active"),
    [
        # Mistral's announcement: 46.7B parameters, 12.9B used per token.
        ("mixtral-8x7b", 46_702_792_704, 12_879_925_248),
        # OLMoE paper: 6.9B total, 1.3B active (QK-norm weights not modelled: 65,536 fewer).
        ("olmoe-1b-7b", 6_919_096_320, 1_281_951_744),
    ],
)
def test_presets_match_published_shapes(preset: str, total: int, active: int) -> None:
    cfg = model_preset(preset)
    assert (count_parameters(cfg), count_active_parameters(cfg)) == (total, active)
    meta = build_model(cfg, seed=0, device="meta")
    assert sum(p.numel() for p in meta.parameters()) == total


def test_moe_micro_trains_forward_and_backward_with_every_parameter() -> None:
    cfg = model_preset("moe-micro")
    model = build_model(cfg, seed=0)
    model(torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))).float().pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    layers = moe_layers(model)
    assert len(layers) == cfg.n_layers
    routed, dropped = layers[0].take_counts()
    assert sum(routed) == 2 * cfg.seq_len * cfg.top_k and dropped == [0] * cfg.num_experts
    assert layers[0].take_counts() == ([0] * cfg.num_experts, [0] * cfg.num_experts)  # taken means reset


def layer(**changes: object) -> MoE:
    torch.manual_seed(0)
    moe = MoE(dataclasses.replace(MOE, **changes))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return moe


def test_uniform_router_has_balancing_loss_equal_to_its_coefficient() -> None:
    """E * sum_e f_e P_e with P_e = 1/E is 1 whatever the counts f: the loss is then exactly its coefficient."""
    moe = layer(aux_loss_coef=0.5, z_loss_coef=0.0)
    torch.nn.init.zeros_(moe.router.weight)
    moe(torch.randn(10, 16))
    assert moe.aux_loss is not None and moe.aux_loss.item() == pytest.approx(0.5)


def test_skewed_router_pays_more_balancing_loss_and_z_loss_adds() -> None:
    moe = layer(aux_loss_coef=1.0, z_loss_coef=0.0)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 5.0  # expert 0 wins every token (inputs kept positive)
    x = torch.rand(10, 16)
    moe(x)
    skewed = moe.aux_loss.item()
    assert skewed > 1.5
    moe.z_loss_coef = 0.1
    moe(x)
    z = 0.1 * torch.logsumexp(moe.router(x), dim=-1).square().mean().item()
    assert moe.aux_loss.item() == pytest.approx(skewed + z, rel=1e-5)
    assert auxiliary_loss([moe, moe]).item() == pytest.approx(2 * moe.aux_loss.item())


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
def test_gates_pick_top_k_experts_with_renormalised_weights(gate: str) -> None:
    moe = layer(router_gate=gate)
    experts, weights = moe.route(torch.randn(6, 16))
    assert experts.shape == weights.shape == (6, 2)
    assert torch.allclose(weights.sum(-1), torch.ones(6))
    assert (experts[:, 0] != experts[:, 1]).all()


def test_capacity_drops_assignments_over_it_and_dropless_keeps_all() -> None:
    x = torch.rand(12, 16)
    skewed = layer(capacity_factor=1.0, num_shared_experts=0)
    with torch.no_grad():
        skewed.router.weight.zero_()
        skewed.router.weight[0] = 5.0
        skewed.router.weight[1] = 4.0  # every token picks experts 0 and 1
    out = skewed(x)
    # Capacity 1.0 x 12 tokens x 2 / 4 experts = 6 per expert: experts 0 and 1 get 12 each, 6 dropped each.
    assert skewed.take_counts() == ([12, 12, 0, 0], [6, 6, 0, 0])
    kept = torch.zeros(12, dtype=torch.bool)
    kept[:6] = True  # the first tokens keep their places (token order within each choice rank)
    assert (out[~kept] == 0).all() and (out[kept] != 0).any(dim=-1).all()
    skewed.capacity_factor = None
    skewed(x)
    assert skewed.take_counts() == ([12, 12, 0, 0], [0, 0, 0, 0])


def test_regroup_orders_rows_by_expert_then_source() -> None:
    # Rows from 2 source ranks x 2 local experts, segments of sizes [[1, 2], [3, 0]].
    counts = torch.tensor([[1, 2], [3, 0]])
    rows = torch.tensor([0, 10, 10, 1, 1, 1])  # 10 x expert + source: source 0 sends e0, e1, e1; source 1 e0 x3
    order = regroup(counts)
    assert order.tolist() == [0, 3, 4, 5, 1, 2]
    assert rows[order].tolist() == [0, 1, 1, 1, 10, 10]  # expert 0 from sources 0 then 1, then expert 1


def test_expert_init_does_not_depend_on_how_experts_are_split() -> None:
    full = build_model(MOE, seed=3)
    with torch.device("meta"):
        part = type(full)(MOE)
    part.to_empty(device="cpu")
    for moe in moe_layers(part):  # a rank of ep=2 holding experts 2 and 3
        experts = moe.experts
        experts.offset = 2
        for name in ("w1", "w2", "w3"):
            setattr(experts, name, torch.nn.Parameter(torch.empty_like(getattr(experts, name)[2:])))
    part.init_weights(3)
    for whole, half in zip(moe_layers(full), moe_layers(part), strict=True):
        assert torch.equal(whole.experts.w2[2:], half.experts.w2)
        assert torch.equal(whole.router.weight, half.router.weight)


def refused(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        validate_run(parse_run_config(compose_train(overrides)))
    return err.value


FSDP_EP = ["model=moe-micro", "strategy=fsdp", "hw.devices_per_node=4"]


@pytest.mark.parametrize(
    ("overrides", "key", "fix"),
    [
        (["strategy.ep=3"], "strategy.ep", "divisor of 4"),
        (["strategy.ep=4", "model.num_experts=6"], "strategy.ep", "[1, 2]"),
        (["strategy.ep=2", "model=gpt-nano"], "strategy.ep", "model=moe-micro"),
        (["strategy.ep=0"], "strategy.ep", "strategy.ep=1"),
        (["strategy.ep=2", "strategy.dp_replicate=2"], "strategy.ep", "dp_replicate=1"),
        (["model.top_k=5"], "model.top_k", "<= 4"),
        (["model.capacity_factor=0"], "model.capacity_factor", "null for dropless"),
        (["model.router_gate=sigmod"], "model.router_gate", "sigmoid"),
        (["model.num_experts=0"], "model.num_shared_experts", "model.num_experts"),
        (
            ["strategy=megatron", "strategy.tp=2", "strategy.sequence_parallel=true"],
            "strategy.sequence_parallel",
            "=false",
        ),
        (["strategy=megatron", "strategy.tp=4", "model.num_experts=6"], "strategy.tp", "dividing 6: [1, 2, 3, 6]"),
    ],
)
def test_impossible_expert_layouts_are_refused_with_key_and_fix(overrides: list[str], key: str, fix: str) -> None:
    err = refused([*FSDP_EP, *overrides])
    assert err.key == key and fix in str(err)


def test_expert_parallel_layout_that_fits_is_accepted() -> None:
    validate_run(parse_run_config(compose_train([*FSDP_EP, "strategy.ep=2"])))
    validate_expert_parallel(4, model_preset("moe-micro"), 8)
    # Expert-parallel runs write universal checkpoints (strategies/expert_checkpoint): step checkpoints are fine.
    validate_run(parse_run_config(compose_train([*FSDP_EP, "strategy.ep=2", "trainer.ckpt_every_n_steps=10"])))
    # Under strategy=megatron the tp ranks split the experts.
    validate_run(parse_run_config(compose_train([*FSDP_EP, "strategy=megatron", "strategy.tp=2"])))


def test_recomputed_forward_does_not_count_tokens_twice() -> None:
    cfg = model_preset("moe-micro")
    model = build_model(cfg, seed=0)
    apply_activation_checkpointing(model)
    model(torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))).float().pow(2).mean().backward()
    routed, _ = moe_layers(model)[0].take_counts()
    assert sum(routed) == 2 * cfg.seq_len * cfg.top_k


def _expert_pass(experts: torch.nn.Module, x: torch.Tensor, counts: list[int], grad: torch.Tensor) -> list:
    experts.zero_grad()
    x = x.detach().requires_grad_()
    out = experts(x, counts)
    out.backward(grad)
    return [out, x.grad, *(p.grad for p in experts.parameters())]


def test_grouped_gemm_computes_what_the_per_expert_loop_does() -> None:
    """One grouped GEMM per projection (the CUDA path on H100s) against the loop, in bf16 on the CPU (its kernel has
    a CPU version): the same outputs and gradients, a zero gradient for an expert without tokens."""
    from disttrain.models.moe import GroupedExperts

    cfg = model_preset("moe-micro")
    experts = GroupedExperts(cfg, 4)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    experts = experts.to(torch.bfloat16)
    counts = [5, 0, 9, 2]
    x = torch.randn(sum(counts), cfg.d_model, generator=gen).bfloat16()
    grad = torch.randn(sum(counts), cfg.d_model, generator=gen).bfloat16()
    experts.grouped_gemm = False
    loop = _expert_pass(experts, x, counts, grad)
    experts.grouped_gemm = True
    grouped = _expert_pass(experts, x, counts, grad)
    for a, b in zip(loop, grouped, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    assert all(torch.count_nonzero(p.grad[1]) == 0 for p in experts.parameters())


def test_attached_auxiliary_loss_trains_the_routers_as_the_objective_does() -> None:
    """Pipeline stages cannot add their layers' balancing loss to the objective: each layer attaches its gradient
    (times the objective's scale) to its output instead. The gradients are those of ``loss + aux``."""
    cfg = model_preset("moe-micro")
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    grads = []
    for attach in (False, True):
        model = build_model(cfg, seed=4)
        layers = moe_layers(model)
        for layer in layers:
            layer.attach_aux_scale = 0.5 if attach else None
        loss = model(tokens).float().square().mean()
        objective = loss * 0.5 if attach else (loss + auxiliary_loss(layers)) * 0.5
        objective.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert any(n.endswith("router.weight") for n in grads[0])
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-7, rtol=1e-5, msg=name)


def test_expert_checkpoint_names_are_the_state_dicts_under_activation_checkpointing() -> None:
    """Expert-parallel experts are described to DCP by the names get_model_state_dict gives, which drop the wrappers
    activation checkpointing inserts: with the wrapped names no key matched, and each rank wrote its own experts as
    the whole tensor (a checkpoint no other ep could resume, and an HF export that crashed)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from disttrain.models.moe import shard_experts
    from disttrain.strategies.expert_checkpoint import expert_parameter_names

    model = build_model(model_preset("moe-micro"), seed=0)
    shard_experts(model, ep_rank=1, ep_size=2, ep_group=None, balance_group=None)
    apply_activation_checkpointing(model)
    assert any("_checkpoint_wrapped_module" in name for name, _ in model.named_parameters())
    names = expert_parameter_names(model)
    assert len(names) == 2 * 3  # two layers' w1, w2, w3
    assert set(names) <= set(get_model_state_dict(model))
    assert {v[:3] for v in names.values()} == {(2, 1, 2)}  # ep 2, this rank's index 1, 2 experts each
    assert {v.placement for v in names.values()} == {None}  # contiguous: DTensor views
