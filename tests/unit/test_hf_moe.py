"""transformers MoE families (Mixtral, Qwen2-MoE, OLMoE) run through the project's expert layers: the same function
and gradients as transformers' own blocks, HF's balancing loss over the global batch, their shape for the planner,
and their weights read from checkpoints that store experts fused or one by one."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from disttrain.config.errors import ConfigError
from disttrain.config.experts import validate_expert_parallel, validate_megatron_experts
from disttrain.config.hf import hf_shape, legacy_expert_sources, load_hf_config
from disttrain.config.schema import HFModelConfig
from disttrain.config.strategy_schema import MegatronConfig
from disttrain.models.accounting import count_parameters
from disttrain.models.hf import SafetensorsWeights, build_hf_model
from disttrain.models.hf_moe import HFExperts
from disttrain.models.moe import moe_layers, shard_experts
from tests.hf_fixtures import TINY_LLAMA, TINY_MIXTRAL, TINY_MOE_CONFIGS, save_tiny_model


def _model_cfg(config: dict, path: str | None = None) -> HFModelConfig:
    return HFModelConfig(name="tiny-moe", config=None if path else dict(config), path=path, seq_len=16)


def _hf_reference(cfg: HFModelConfig, state: dict[str, torch.Tensor], **overrides: object) -> torch.nn.Module:
    """transformers' own model (its fused experts untouched) holding ``state``."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(load_hf_config(cfg))
    for key, value in overrides.items():
        setattr(config, key, value)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    reference.load_state_dict(state)
    return reference


@pytest.mark.parametrize("family", sorted(TINY_MOE_CONFIGS))
def test_adopted_experts_compute_what_transformers_computes(family: str) -> None:
    cfg = _model_cfg(TINY_MOE_CONFIGS[family])
    model = build_hf_model(cfg, seed=1)
    layers = moe_layers(model)
    assert len(layers) == 2 and all(isinstance(layer, HFExperts) for layer in layers)
    # Same parameters under the same names: checkpoints and save_pretrained see transformers' own layout.
    reference = _hf_reference(cfg, model.hf.state_dict())
    assert [n for n, _ in model.hf.named_parameters()] == [n for n, _ in reference.named_parameters()]
    tokens = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(0))
    ours, theirs = model(tokens), reference(input_ids=tokens, use_cache=False).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    ours.square().mean().backward()
    theirs.square().mean().backward()
    their_grads = dict(reference.named_parameters())
    for name, param in model.hf.named_parameters():
        torch.testing.assert_close(param.grad, their_grads[name].grad, atol=1e-6, rtol=1e-4, msg=name)
    # Counters: every token's top-k choices, per layer.
    k = TINY_MOE_CONFIGS[family]["num_experts_per_tok"]
    assert [sum(layer.take_counts()[0]) for layer in layers] == [3 * 16 * k] * 2


@pytest.mark.parametrize("family", sorted(TINY_MOE_CONFIGS))
def test_balancing_loss_is_transformers_router_aux_loss(family: str) -> None:
    # One MoE layer: HF's loss over the layers' tokens together is then exactly the per-layer loss.
    config = {**TINY_MOE_CONFIGS[family], "num_hidden_layers": 1}
    cfg = _model_cfg(config)
    model = build_hf_model(cfg, seed=2).train()
    reference = _hf_reference(cfg, model.hf.state_dict(), output_router_logits=True).train()
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    model(tokens)
    (ours,) = [layer.aux_loss for layer in moe_layers(model)]
    out = reference(input_ids=tokens, labels=tokens, use_cache=False)
    theirs = out.aux_loss * config["router_aux_loss_coef"]
    torch.testing.assert_close(ours, theirs, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("family", sorted(TINY_MOE_CONFIGS))
def test_hot_expert_fault_routes_every_token_of_its_layer_to_the_favoured_experts(family: str) -> None:
    """transformers' routers choose inside their forward: the fault routes their tokens again from biased logits,
    renormalised as the family does, and the balancing loss reads the same biased logits."""
    from disttrain.reliability.faults import HOT_EXPERT_BIAS, FaultInjection, parse_fault

    model = build_hf_model(_model_cfg(TINY_MOE_CONFIGS[family]), seed=3).train()
    k = TINY_MOE_CONFIGS[family]["num_experts_per_tok"]
    injection = FaultInjection([parse_fault(f"hot_expert@step=2,layer=1,experts={k}")])
    injection.rank = 0
    injection.on_train_start(None, model)  # type: ignore[arg-type]
    tokens = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(2))
    first, second = moe_layers(model)
    router = second.routing_module
    for step, hot in ((1, False), (2, True)):
        injection.step = step
        seen: list[tuple] = []
        handle = router.register_forward_hook(lambda m, a, out, seen=seen: seen.append(out))
        model(tokens)
        handle.remove()
        routed = second.take_counts()[0]
        assert (routed[:k] == [48] * k) is hot and sum(routed) == 48 * k  # every token's top-k: the favoured ones
        assert sum(first.take_counts()[0][:k]) < 48 * k  # the other layer routes as trained
        if hot:
            logits, weights, _ = seen[0]
            assert logits.max(dim=-1).values.min() > HOT_EXPERT_BIAS - 1  # the loss reads the biased logits
            renormalised = getattr(router, "norm_topk_prob", True)
            assert torch.allclose(weights.sum(-1), torch.ones(48), atol=1e-5) == renormalised


def test_balancing_loss_weight_is_shared_over_layers_and_off_at_zero() -> None:
    model = build_hf_model(_model_cfg(TINY_MIXTRAL), seed=0)
    coefs = [layer.aux_loss_coef for layer in moe_layers(model)]
    assert coefs == pytest.approx([0.02 * 2 / 2] * 2)  # setting x top_k / layers
    assert {layer.aux_loss_setting for layer in moe_layers(model)} == {0.02}
    off = build_hf_model(_model_cfg({**TINY_MIXTRAL, "router_aux_loss_coef": 0.0}), seed=0).train()
    off(torch.randint(0, 128, (2, 8)))
    assert all(layer.aux_loss is None for layer in moe_layers(off))


def test_expert_parallel_slice_draws_the_rows_of_the_whole_init() -> None:
    whole = build_hf_model(_model_cfg(TINY_MIXTRAL), seed=5)
    part = build_hf_model(_model_cfg(TINY_MIXTRAL), seed=5, placement="deferred")
    shard_experts(part, ep_rank=1, ep_size=2, ep_group=None, balance_group=None)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    param = part.hf.get_parameter(name)
    assert tuple(param.shape) == (2, 96, 32) and part.expert_parallel
    torch.testing.assert_close(part.initial_value([name], param.shape), whole.hf.get_parameter(name).detach()[2:4])

    # Placed (strategy.expert_placement): rank 1 of the group holds slots 2-3, experts 2 and 1, in that order.
    placed = build_hf_model(_model_cfg(TINY_MIXTRAL), seed=5, placement="deferred")
    shard_experts(placed, ep_rank=1, ep_size=2, ep_group=None, balance_group=None, placement=[[3, 0, 2, 1]])
    expected = whole.hf.get_parameter(name).detach()[[2, 1]]
    torch.testing.assert_close(placed.initial_value([name], param.shape), expected)


def test_fused_expert_rows_are_read_in_the_order_asked(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    fused = torch.randn(4, 6, 3)
    save_file({"model.layers.0.mlp.experts.down_proj": fused}, str(tmp_path / "model.safetensors"))
    weights = SafetensorsWeights(tmp_path)
    torch.testing.assert_close(weights.get("model.layers.0.mlp.experts.down_proj", [3, 1]), fused[[3, 1]])
    torch.testing.assert_close(weights.get("model.layers.0.mlp.experts.down_proj"), fused)


def test_fused_weights_are_read_from_per_expert_checkpoints(tmp_path: Path) -> None:
    # save_pretrained writes Mixtral's experts one by one under the old block name (block_sparse_moe.experts.<e>.w1).
    directory = save_tiny_model(tmp_path / "mixtral", TINY_MIXTRAL)
    weights = SafetensorsWeights(directory)
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in weights.files
    sources = legacy_expert_sources("model.layers.0.mlp.experts.gate_up_proj", weights.files)
    assert sources is not None and len(sources) == 4 and sources[0][1].endswith("experts.0.w3.weight")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        fused = loaded.get_parameter(name).detach()
        torch.testing.assert_close(weights.get(name), fused)
        torch.testing.assert_close(weights.get(name, [2, 3]), fused[2:4])
        torch.testing.assert_close(weights.get(name, [3, 0]), fused[[3, 0]])  # a placed rank's experts, in its order
    torch.testing.assert_close(weights.get("model.layers.0.mlp.gate.weight"), loaded.model.layers[0].mlp.gate.weight)
    # Read from model.path there is no model.config to override: no balancing-weight lever for the report.
    from_path = build_hf_model(_model_cfg(TINY_MIXTRAL, path=str(directory)), seed=0)
    assert {layer.balance_key for layer in moe_layers(from_path)} == {None}
    assert {layer.balance_key for layer in moe_layers(build_hf_model(_model_cfg(TINY_MIXTRAL), seed=0))} == {
        "model.config.router_aux_loss_coef"
    }
    # A deferred build reads every tensor through them: the whole model is the one from_pretrained loads.
    cfg = _model_cfg(TINY_MIXTRAL, path=str(directory))
    deferred = build_hf_model(cfg, seed=0, placement="deferred")
    deferred.materialize_by_module(fill=True, partition=None)
    for name, param in loaded.named_parameters():
        torch.testing.assert_close(deferred.hf.get_parameter(name), param, msg=name)


def test_hf_moe_shape_for_the_planner() -> None:
    mixtral = hf_shape(_model_cfg(TINY_MIXTRAL))
    assert (mixtral.num_experts, mixtral.top_k, mixtral.expert_hidden, mixtral.num_shared_experts) == (4, 2, 48, 0)
    assert mixtral.router_norm_topk and mixtral.aux_loss_coef == 0.02 and mixtral.z_loss_coef == 0.0
    # Mixtral's shape is exact: the planner counts what the model holds.
    model = build_hf_model(_model_cfg(TINY_MIXTRAL), seed=0, device="meta")
    assert count_parameters(mixtral) == sum(p.numel() for p in model.parameters())
    qwen = hf_shape(_model_cfg(TINY_MOE_CONFIGS["qwen2_moe"]))
    assert (qwen.num_experts, qwen.top_k, qwen.expert_hidden, qwen.num_shared_experts) == (8, 3, 24, 2)
    assert not qwen.router_norm_topk
    assert hf_shape(_model_cfg(TINY_LLAMA)).num_experts == 0


def test_expert_parallel_rules_for_hf_models() -> None:
    moe = _model_cfg(TINY_MIXTRAL)
    validate_expert_parallel(2, moe, 4)
    validate_expert_parallel(4, moe, 4)
    with pytest.raises(ConfigError, match="4 experts cannot be split evenly over ep=3") as err:
        validate_expert_parallel(3, moe, 6)
    assert "strategy.ep" in str(err.value)
    with pytest.raises(ConfigError, match="dense model without routed experts"):
        validate_expert_parallel(2, _model_cfg(TINY_LLAMA), 2)
    with pytest.raises(ConfigError, match="no tensor-parallel plan for transformers' MoE blocks"):
        validate_megatron_experts(MegatronConfig(tp=2), moe)
    validate_megatron_experts(MegatronConfig(tp=2), _model_cfg(TINY_LLAMA))


def test_grouped_gemm_runs_the_fused_experts_as_the_loop_does() -> None:
    """The CUDA path (one grouped GEMM per projection over the transposed fused weights) against the loop, in bf16
    on the CPU: the same outputs and gradients."""
    model = build_hf_model(_model_cfg(TINY_MIXTRAL), seed=3).to(torch.bfloat16)
    layer = moe_layers(model)[0]
    counts = [4, 0, 7, 3]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 32, generator=gen).bfloat16()
    grad = torch.randn(sum(counts), 32, generator=gen).bfloat16()
    results = []
    for grouped in (False, True):
        layer.grouped_gemm = grouped
        layer.zero_grad()
        tokens = x.clone().requires_grad_()
        layer._compute(tokens, counts).backward(grad)
        results.append([tokens.grad, layer.gate_up_proj.grad, layer.down_proj.grad])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_expert_imbalance_levers_follow_the_model_kind() -> None:
    """The balancing lever names the key that sets it (an HF model's own config), none where nothing can be
    overridden (model.path) and no capacity lever for dropless HF models."""
    from diagnostics.analysis import Finding
    from diagnostics.analysis.context import RunContext
    from diagnostics.analysis.finding import cost
    from diagnostics.recommend import recommend

    def levers(**keys: object) -> list[str]:
        evidence = {"aux_loss_coef": 0.001, "capacity_factor": None, "load_excess": 0.6, **keys}
        finding = Finding("expert_imbalance", "warning", [0], evidence, "hot experts", cost=cost(0.2, "test"))
        return [r.override for r in recommend(finding, RunContext({}, {}, 2))]

    assert levers() == ["model.aux_loss_coef=0.01", "model.capacity_factor=1.25"]  # built-in (older records too)
    inline = levers(aux_loss_key="model.config.router_aux_loss_coef", capacity_key=None)
    assert inline == ["model.config.router_aux_loss_coef=0.01"]
    assert levers(aux_loss_key=None, capacity_key=None) == []
