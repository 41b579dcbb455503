"""Reference transformer: presets match published parameter counts, forward semantics, init, accounting."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from disttrain.config.schema import ModelConfig
from disttrain.models import (
    Transformer,
    apply_activation_checkpointing,
    build_model,
    count_embedding_parameters,
    count_parameters,
    flops_per_token,
    hardware_flops_per_token,
    matmul_parameters,
)
from tests.conftest import MODEL_PRESETS as PRESETS
from tests.conftest import model_preset as load_preset

# Published totals (embeddings included, tied LM head counted once).
PUBLISHED = {
    "gpt2-124m": 124_439_808,
    "gpt2-350m": 354_823_168,
    "llama-1b": 1_235_814_400,
    "llama-7b": 6_738_415_616,
    "llama-13b": 13_015_864_320,
    "llama-70b": 68_976_648_192,
    "mixtral-8x7b": 46_702_792_704,
}
# Presets whose totals differ from a published one (the differences are in each file's header) or CPU-sized.
UNPUBLISHED = {"gpt-nano", "gpt-micro", "moe-micro", "olmoe-1b-7b", "deepseek-moe-16b"}

GPT_SMALL = ModelConfig(name="gpt-test", n_layers=2, d_model=32, n_heads=4, ffn_hidden=64, vocab_size=50, seq_len=16)
LLAMA_SMALL = ModelConfig(
    name="llama-test",
    family="llama",
    n_layers=2,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    ffn_hidden=48,
    vocab_size=50,
    seq_len=16,
    norm="rmsnorm",
    mlp="swiglu",
    pos_emb="rope",
    bias=False,
    tie_embeddings=False,
)
SMALL = [pytest.param(GPT_SMALL, id="gpt"), pytest.param(LLAMA_SMALL, id="llama")]


def numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def tokens(cfg: ModelConfig, batch: int = 2, seq: int | None = None, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(cfg.vocab_size, (batch, seq or cfg.seq_len), generator=gen)


def test_all_expected_presets_exist() -> None:
    assert {p.stem for p in PRESETS} == set(PUBLISHED) | UNPUBLISHED


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_parameter_count(path: Path) -> None:
    cfg = load_preset(path)
    assert cfg.name == path.stem
    assert path.read_text().startswith("#"), "each preset cites the source of its shape"
    # Every field set explicitly, so a preset never silently inherits a schema default.
    assert set(OmegaConf.load(path).keys()) == {f.name for f in dataclasses.fields(ModelConfig)}
    expected = count_parameters(cfg)
    if expected > 50_000_000:
        with torch.device("meta"):
            model = Transformer(cfg)
    else:
        model = build_model(cfg, seed=0)
    assert numel(model) == expected
    if cfg.name in PUBLISHED:
        assert expected == PUBLISHED[cfg.name]


def test_gpt_nano_is_cpu_sized() -> None:
    cfg = load_preset("gpt-nano")
    assert 1_000_000 <= count_parameters(cfg) <= 3_000_000


@pytest.mark.parametrize("cfg", SMALL)
def test_count_parameters_matches_small_models(cfg: ModelConfig) -> None:
    for variant in (cfg, dataclasses.replace(cfg, bias=not cfg.bias, tie_embeddings=not cfg.tie_embeddings)):
        assert count_parameters(variant) == numel(Transformer(variant))


def test_embedding_and_matmul_parameters() -> None:
    gpt2 = load_preset("gpt2-124m")
    wte, wpe = 50257 * 768, 1024 * 768
    assert count_embedding_parameters(gpt2) == wte + wpe == 39_383_808
    # Tied: the shared matrix counts once, as the LM head; the position embedding is not a matmul.
    assert matmul_parameters(gpt2) == 124_439_808 - wpe == 123_653_376
    llama = load_preset("llama-7b")
    assert count_embedding_parameters(llama) == 32000 * 4096
    # Untied: the token-embedding lookup drops out, the separate LM head stays.
    assert matmul_parameters(llama) == 6_738_415_616 - 32000 * 4096


@pytest.mark.parametrize("cfg", SMALL)
def test_forward_shape_and_shorter_sequence(cfg: ModelConfig) -> None:
    model = build_model(cfg, seed=0)
    assert model(tokens(cfg)).shape == (2, cfg.seq_len, cfg.vocab_size)
    assert model(tokens(cfg, seq=5)).shape == (2, 5, cfg.vocab_size)


@pytest.mark.parametrize("cfg", SMALL)
def test_sequence_longer_than_seq_len_raises(cfg: ModelConfig) -> None:
    model = build_model(cfg, seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        model(tokens(cfg, seq=cfg.seq_len + 1))


@pytest.mark.parametrize("cfg", SMALL)
def test_causal(cfg: ModelConfig) -> None:
    model = build_model(cfg, seed=0).eval()
    x = tokens(cfg, batch=1)
    t = 9
    y = x.clone()
    y[0, t] = (x[0, t] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_grouped_query_attention_runs_and_is_smaller() -> None:
    gqa = LLAMA_SMALL
    mha = dataclasses.replace(gqa, n_kv_heads=None)
    assert gqa.kv_heads < gqa.n_heads
    assert count_parameters(gqa) < count_parameters(mha)
    model = build_model(gqa, seed=0)
    assert model.blocks[0].attn.wk.weight.shape == (gqa.kv_heads * gqa.head_dim, gqa.d_model)
    assert torch.isfinite(model(tokens(gqa))).all()


def test_rope_carries_position() -> None:
    # In a one-layer model without position information, causal attention at the last position sees the
    # prefix as a set, so permuting the prefix leaves its logits unchanged; with RoPE they must change.
    rope_cfg, no_pos_cfg = (dataclasses.replace(c, n_layers=1) for c in (LLAMA_SMALL, GPT_SMALL))
    x = tokens(rope_cfg, batch=1)
    last = rope_cfg.seq_len - 1
    perm = torch.cat((torch.randperm(last, generator=torch.Generator().manual_seed(1)), torch.tensor([last])))
    x_perm = x[:, perm]
    rope = build_model(rope_cfg, seed=0).eval()
    no_pos = build_model(no_pos_cfg, seed=0).eval()
    torch.nn.init.zeros_(no_pos.pos_emb.weight)
    with torch.no_grad():
        assert not torch.allclose(rope(x)[:, -1], rope(x_perm)[:, -1], atol=1e-5)
        assert torch.allclose(no_pos(x)[:, -1], no_pos(x_perm)[:, -1], atol=1e-5)


@pytest.mark.parametrize("cfg", SMALL)
def test_init_is_deterministic_and_leaves_global_rng_alone(cfg: ModelConfig) -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = build_model(cfg, seed=7), build_model(cfg, seed=7), build_model(cfg, seed=8)
    a.init_weights(7)
    assert torch.equal(torch.get_rng_state(), before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(not torch.equal(sa[k], sc[k]) for k in sa if k.endswith("weight") and "norm" not in k)


def test_init_statistics() -> None:
    cfg = dataclasses.replace(GPT_SMALL, d_model=256, n_heads=4, ffn_hidden=512, n_layers=8)
    model = build_model(cfg, seed=0)
    block = model.blocks[0]
    assert block.attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    # Residual output projections are scaled by 1/sqrt(2 * n_layers) = 1/4.
    assert block.attn.wo.weight.std().item() == pytest.approx(0.005, rel=0.05)
    assert block.mlp.w2.weight.std().item() == pytest.approx(0.005, rel=0.05)
    assert torch.equal(block.attn.wq.bias, torch.zeros_like(block.attn.wq.bias))
    assert torch.equal(block.norm1.weight, torch.ones_like(block.norm1.weight))
    assert model.lm_head.weight is model.tok_emb.weight


def test_meta_build_materializes_to_the_same_model() -> None:
    meta = build_model(LLAMA_SMALL, seed=3, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.init_weights(3)
    ref = build_model(LLAMA_SMALL, seed=3)
    assert torch.equal(meta.rope_cos, ref.rope_cos) and torch.equal(meta.rope_sin, ref.rope_sin)
    x = tokens(LLAMA_SMALL)
    assert torch.equal(meta(x), ref(x))


@pytest.mark.parametrize("cfg", SMALL)
def test_activation_checkpointing_keeps_gradients_names_and_init(cfg: ModelConfig) -> None:
    x = tokens(cfg)
    ref = build_model(cfg, seed=0)
    ckpt = build_model(cfg, seed=0)
    apply_activation_checkpointing(ckpt)
    apply_activation_checkpointing(ckpt)  # idempotent
    assert isinstance(ckpt.blocks, torch.nn.ModuleList) and len(ckpt.blocks) == cfg.n_layers
    assert ref.state_dict().keys() == ckpt.state_dict().keys()
    for model in (ref, ckpt):
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    ckpt_grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in ckpt.named_parameters()}
    assert ref_grads.keys() == ckpt_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-6, atol=1e-6, msg=name)
    # Init seeds come from canonical names, so wrapping before init_weights gives the same weights.
    ckpt.init_weights(5)
    ref.init_weights(5)
    sd_ref, sd_ckpt = ref.state_dict(), ckpt.state_dict()
    assert all(torch.equal(sd_ref[k], sd_ckpt[k]) for k in sd_ref)


def test_flops_per_token_gpt2_124m() -> None:
    cfg = load_preset("gpt2-124m")
    # N' = 124,439,808 total - 786,432 (wpe) = 123,653,376 (tied wte counted once, as the LM head).
    # 6 N'             = 741,920,256
    # 12 L H Q T       = 12 * 12 * 12 * 64 * 1024 = 113,246,208
    expected = 741_920_256 + 113_246_208
    assert expected == 855_166_464
    assert flops_per_token(cfg, seq_len=1024) == expected
    assert flops_per_token(cfg) == expected  # seq_len defaults to cfg.seq_len = 1024
    assert hardware_flops_per_token(cfg, seq_len=1024) == expected
    # Full checkpointing recomputes one forward of the blocks: + 2 * 12 * 7,087,872 + 4 * 12 * 12 * 64 * 1024.
    block = 2 * (2 * 768) + (4 * 768 * 768 + 4 * 768) + (2 * 768 * 3072 + 3072 + 768)
    assert block == 7_087_872
    recompute = 2 * 12 * block + 4 * 12 * 12 * 64 * 1024
    assert hardware_flops_per_token(cfg, seq_len=1024, activation_checkpointing=True) == expected + recompute


@pytest.mark.parametrize(
    "change",
    [{"norm": "batchnorm"}, {"mlp": "relu"}, {"pos_emb": "alibi"}, {"n_heads": 5}, {"n_kv_heads": 3}],
)
def test_invalid_config_raises(change: dict) -> None:
    with pytest.raises(ValueError):
        Transformer(dataclasses.replace(GPT_SMALL, **change))
