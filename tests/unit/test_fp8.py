"""precision=fp8: which layers torchao converts, and the refusals before launch (no GPU needed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from disttrain.config.errors import ConfigError
from disttrain.config.parse import parse_model, parse_run_config
from disttrain.job.prepare import check_fp8_device
from disttrain.models.factory import Fp8Linears, _build_reference_model
from disttrain.models.fp8 import fp8_eligible
from disttrain.strategies.layout import parallel_layout, validate_run
from tests.conftest import compose_train


def test_the_head_and_unaligned_layers_stay_in_bf16() -> None:
    assert fp8_eligible(nn.Linear(64, 128), "blocks.0.attn.wq")
    assert not fp8_eligible(nn.Linear(64, 128), "lm_head")
    assert not fp8_eligible(nn.Linear(64, 100), "blocks.0.mlp.w1")  # 100 is no multiple of 16
    assert not fp8_eligible(nn.Embedding(10, 64), "tok_emb")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_every_block_linear_of_the_reference_model_is_converted(recipe: str) -> None:
    from torchao.float8.float8_linear import Float8Linear

    cfg = parse_model(dict(compose_train(["model=llama-1b"]).model))
    model = _build_reference_model(cfg, 0, device="meta", fp8=Fp8Linears(recipe))
    converted = [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert len(converted) == 7 * cfg.n_layers  # wq wk wv wo w1 w2 w3 in every block
    assert type(model.lm_head) is nn.Linear
    # Same parameter names: checkpoints move between bf16 and fp8 runs.
    plain = _build_reference_model(cfg, 0, device="meta")
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]


def refusal(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as raised:
        validate_run(parse_run_config(compose_train(overrides)))
    return raised.value


def test_fp8_is_refused_where_there_are_no_fp8_tensor_cores() -> None:
    for hw in ("hw=cpu", "hw=1xa100"):
        err = refusal(["precision=fp8", hw])
        assert err.key == "precision" and "fp8 tensor cores" in str(err)
    err = refusal(["precision=fp8", "hw=8xh100", "strategy=deepspeed"])
    assert "strategy=deepspeed" in str(err)
    err = refusal(["precision=bf16-mixed", "+precision.recipe=rowwise", "hw=8xh100"])
    assert err.key == "precision.recipe"
    err = refusal(["precision=fp8", "precision.recipe=blockwise", "hw=8xh100"])
    assert err.key == "precision.recipe"


def test_an_fp8_profile_on_an_older_gpu_is_refused_before_launch() -> None:
    with pytest.raises(ConfigError, match=r"compute capability 8\.9"):
        check_fp8_device("NVIDIA A100-SXM4-80GB", (8, 0))
    check_fp8_device("NVIDIA H200", (9, 0))  # fine


def test_fp8_composes_for_ddp_and_fsdp_on_fp8_hardware() -> None:
    for strategy in ("ddp", "fsdp"):
        cfg = parse_run_config(compose_train(["precision=fp8", "hw=8xh100", f"strategy={strategy}"]))
        validate_run(cfg)
        assert cfg.precision.fp8 and cfg.precision.lightning == "bf16-mixed"
        assert cfg.precision.compute_dtype == "bf16" and cfg.precision.planner == "bf16-mixed"
        assert cfg.model.compile is True  # decided on for a GPU


def test_the_head_is_padded_only_for_the_gemm() -> None:
    from disttrain.models.transformer import head_logits

    head = nn.Linear(8, 50257, bias=False)
    h = torch.randn(2, 3, 8)
    assert torch.equal(head_logits(head, h), head(h))  # on CPU: the layer itself


def test_planning_and_auto_pick_only_layouts_fp8_composes_with() -> None:
    from disttrain.strategies.auto import resolve_auto

    cfg = parse_run_config(compose_train(["precision=fp8", "hw=8xh100", "strategy=auto", "model=llama-1b"]))
    chosen, _ = resolve_auto(cfg, parallel_layout(cfg))
    assert chosen.strategy.name in ("ddp", "fsdp")
    validate_run(chosen)


def test_an_fp8_runs_parts_probe_times_its_block_in_fp8() -> None:
    """The start-up probe converts its block's linear layers as the run converts its model's (their time and the fp8
    inputs they keep for backward are what the planner composes); a bf16 run's probe keeps plain layers."""
    from torchao.float8.float8_linear import Float8Linear

    from disttrain.training.build import parts_probe

    cfg = parse_run_config(compose_train(["model=gpt-nano", "precision=fp8", "precision.recipe=rowwise"]))
    probe = parts_probe(cfg)
    assert probe is not None and probe.keywords["fp8"] == Fp8Linears("rowwise")
    block = probe(torch.device("cpu"))["block"]
    linears = 4 + (3 if cfg.model.mlp == "swiglu" else 2)  # wq wk wv wo, then the MLP's two (three gated)
    assert sum(isinstance(m, Float8Linear) for m in block.modules()) == linears
    assert all(type(m) is not Float8Linear for m in probe(torch.device("cpu"))["edges"].modules())
    bf16 = parts_probe(parse_run_config(compose_train(["model=gpt-nano", "precision=bf16-mixed"])))
    assert bf16 is not None and bf16.keywords["fp8"] is None


def test_precision_fp8_head_converts_the_tied_lm_head_too_and_its_probe_times_it() -> None:
    from torchao.float8.float8_linear import Float8Linear

    from disttrain.training.build import parts_probe

    cfg = parse_model(dict(compose_train(["model=llama-1b"]).model))
    model = _build_reference_model(cfg, 0, device="meta", fp8=Fp8Linears("tensorwise", head=True))
    assert isinstance(model.lm_head, Float8Linear)
    assert model.lm_head.weight is model.tok_emb.weight  # still tied: one parameter, one gradient
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 7 * cfg.n_layers + 1
    run = parse_run_config(compose_train(["model=gpt-nano", "precision=fp8", "precision.fp8_head=true"]))
    probe = parts_probe(run)
    assert probe is not None and probe.keywords["fp8"] == Fp8Linears("tensorwise", head=True)
    assert isinstance(probe(torch.device("cpu"))["edges"].lm_head, Float8Linear)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["precision=bf16-mixed", "+precision.fp8_head=true"], "only applies to precision=fp8"),
        (["precision=fp8", "precision.fp8_head=true", "strategy=fsdp"], "strategy=ddp here, not strategy=fsdp"),
        (["precision=fp8", "precision.fp8_head=true", "model=gpt2-124m"], "the head has 50257 rows"),
    ],
)
def test_an_fp8_head_is_refused_before_launch_where_it_cannot_run(overrides: list[str], words: str) -> None:
    err = refusal(["hw=8xh100", *overrides])
    assert err.key == "precision.fp8_head" and words in str(err), str(err)
