"""The HF model wrapper: deterministic init, loading from a local directory, activation checkpointing, export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from disttrain.config.schema import HFModelConfig
from disttrain.models.hf import HFCausalLM, build_hf_model
from tests.hf_fixtures import TINY_LLAMA, save_tiny_model

INLINE = HFModelConfig(name="tiny", config=TINY_LLAMA, seq_len=32)


def tokens() -> torch.Tensor:
    return torch.randint(0, TINY_LLAMA["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))


def test_inline_config_init_is_deterministic_and_leaves_the_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a, b, c = build_hf_model(INLINE, seed=1), build_hf_model(INLINE, seed=1), build_hf_model(INLINE, seed=2)
    assert torch.equal(torch.random.get_rng_state(), state)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), name
            assert abs(float(pa.detach().std()) - 0.02) < 0.005, name  # initializer_range
        else:
            assert torch.equal(pa, torch.ones_like(pa)), name  # RMSNorm weights
    assert torch.equal(a(tokens()), b(tokens()))
    assert len(a.blocks) == TINY_LLAMA["num_hidden_layers"] and a.block_classes == ("LlamaDecoderLayer",)


def test_model_path_loads_the_saved_weights(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    directory = save_tiny_model(tmp_path / "m")
    reference = AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    loaded = build_hf_model(HFModelConfig(path=str(directory), seq_len=32), seed=123).eval()
    with torch.no_grad():
        assert torch.equal(loaded(tokens()), reference(input_ids=tokens()).logits)


def test_meta_build_has_the_structure_without_storage() -> None:
    meta = build_hf_model(INLINE, seed=0, device="meta")
    real = build_hf_model(INLINE, seed=0)
    assert all(p.is_meta for p in meta.parameters())
    assert {k: v.shape for k, v in meta.state_dict().items()} == {k: v.shape for k, v in real.state_dict().items()}


def test_activation_checkpointing_keeps_names_and_gradients() -> None:
    plain, checkpointed = build_hf_model(INLINE, seed=4), build_hf_model(INLINE, seed=4)
    checkpointed.apply_activation_checkpointing()
    checkpointed.apply_activation_checkpointing()  # twice is harmless
    assert list(plain.state_dict()) == list(checkpointed.state_dict())
    assert all(type(b).__name__ == "CheckpointWrapper" for b in checkpointed.blocks)
    for model in (plain, checkpointed):
        model(tokens()).float().logsumexp(-1).mean().backward()
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)


def _saved_elements(model: HFCausalLM) -> tuple[int, torch.Tensor]:
    """Elements autograd keeps for backward during one forward, and the loss."""
    kept: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t, lambda t: t):
        loss = model(tokens()).float().logsumexp(-1).mean()
    return sum(kept), loss


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_selective_recompute_keeps_gradients_and_drops_the_attention_core(kernel: str) -> None:
    from disttrain.config.hf import load_hf_config

    config = HFModelConfig(name="tiny", config=TINY_LLAMA, seq_len=32, attn_implementation=kernel)
    plain, selective = build_hf_model(config, seed=4), build_hf_model(config, seed=4)
    selective.apply_selective_recompute()
    selective.apply_selective_recompute()  # twice is harmless
    assert selective.hf.config._attn_implementation == f"disttrain_recompute_{kernel}"
    # Only this model switched kernels: not the cached config, not another model built from it.
    assert plain.hf.config._attn_implementation == kernel
    assert load_hf_config(config)._attn_implementation in (None, kernel)
    (kept_plain, loss_plain), (kept_selective, loss_selective) = _saved_elements(plain), _saved_elements(selective)
    for loss in (loss_plain, loss_selective):
        loss.backward()
    assert torch.equal(loss_plain, loss_selective)
    for (name, p), q in zip(plain.named_parameters(), selective.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    # Kept by the kernel beyond its q, k, v inputs (which the recomputation keeps instead): with eager, the s x s
    # probabilities (twice: softmax's output, the second matmul's input) and k, v expanded to every query head
    # (GQA) in place of the kv heads; with sdpa (CPU flash kernel), at least its output.
    layers, heads, kv = (TINY_LLAMA[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads"))
    batch, seq, head_dim = 2, 32, TINY_LLAMA["hidden_size"] // heads
    if kernel == "eager":
        per_layer = 2 * batch * heads * seq * seq + 2 * batch * seq * head_dim * (heads - kv)
        assert kept_plain - kept_selective == layers * per_layer
    else:
        assert kept_plain - kept_selective >= layers * batch * heads * seq * head_dim


@pytest.mark.parametrize("config", [TINY_LLAMA, {**TINY_LLAMA, "tie_word_embeddings": True}])
def test_export_reloads_with_from_pretrained_to_the_same_logits(config: dict, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model: HFCausalLM = build_hf_model(HFModelConfig(config=config, seq_len=32), seed=5).eval()
    model.save_pretrained(tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    with torch.no_grad():
        assert torch.equal(model(tokens()), reloaded(input_ids=tokens()).logits)


@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_stages_chained_are_the_whole_model(tied: bool) -> None:
    from disttrain.models.hf_pipeline import build_hf_stage

    config = {**TINY_LLAMA, "num_hidden_layers": 4, "tie_word_embeddings": tied}
    model = HFModelConfig(name="tiny", config=config, seq_len=32)
    whole = build_hf_model(model, seed=3)
    whole.apply_activation_checkpointing()  # as the engine does: layers wrapped before the model is cut
    names = {name: p for name, p in whole.named_parameters(remove_duplicate=False)}
    stages = []
    for stage in range(2):
        wrapper = build_hf_model(model, seed=3)
        wrapper.apply_activation_checkpointing()
        stages.append(build_hf_stage(wrapper, stage, 2))
    first, last = stages
    hidden = first(tokens())
    assert hidden.shape == (2, 32, TINY_LLAMA["hidden_size"])
    assert torch.equal(last(hidden), whole(tokens()))
    # Each stage holds its layers under their global ids; together they are the whole model, each name once.
    held = [dict(s.named_parameters(remove_duplicate=False)) for s in stages]
    assert {n.split(".")[3] for n in held[0] if ".layers." in n} == {"0", "1"}
    assert {n.split(".")[3] for n in held[1] if ".layers." in n} == {"2", "3"}
    assert set(held[0]) | set(held[1]) == set(names) and not set(held[0]) & set(held[1])
    for part in held:
        for name, param in part.items():
            assert torch.equal(param, names[name]), name
    assert first.tok_emb is not None and first.lm_head is None and last.tok_emb is None and last.lm_head is not None
    assert [len(s.blocks) for s in stages] == [2, 2]
    if tied:  # the last stage's head starts as an equal copy of the first stage's embedding
        assert torch.equal(last.lm_head.weight, first.tok_emb.weight)


def test_an_architecture_without_llama_stages_is_refused_by_name() -> None:
    from disttrain.models.hf_pipeline import build_hf_stage, pipeline_structure_problem

    gpt2 = HFModelConfig(name="gpt2", config={"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2})
    wrapper = build_hf_model(gpt2, seed=0)
    problem = pipeline_structure_problem(wrapper)
    assert problem is not None and "embed_tokens" in problem and "layers" in problem
    with pytest.raises(ValueError, match="pipeline stages"):
        build_hf_stage(wrapper, 0, 2)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("source", ["config", "path"])
def test_a_deferred_build_materialized_module_by_module_is_the_whole_build(
    tied: bool, source: str, tmp_path: Path
) -> None:
    """What ZeRO-3 does on rank 0 (partitioning aside): the structure on meta with real buffers, then storage and
    values one module at a time, each module handed on before the next is allocated."""
    config = {**TINY_LLAMA, "tie_word_embeddings": tied}
    model = HFModelConfig(config=config, seq_len=32)
    if source == "path":
        model = HFModelConfig(path=str(save_tiny_model(tmp_path / "m", config)), seq_len=32)
    whole = build_hf_model(model, seed=6)
    deferred = build_hf_model(model, seed=6, placement="deferred")
    assert deferred.deferred and all(p.is_meta for p in deferred.parameters())
    assert not any(b.is_meta for b in deferred.buffers())  # RoPE tables: in no checkpoint, built with the structure
    handed: list[list[torch.Tensor]] = []

    def partition(params: list[torch.nn.Parameter]) -> None:
        # Until now every later module is still on meta: never more than this module is real.
        assert sum(not p.is_meta for p in deferred.parameters()) == sum(map(len, handed)) + len(params)
        handed.append(params)

    peak = deferred.materialize_by_module(fill=True, partition=partition)
    assert not deferred.deferred
    seen: set[int] = set()  # a tied head is the embedding's parameter: allocated (and handed on) once
    per_module = []
    for module in whole.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen |= {id(p) for p in own}
        per_module.append(sum(p.numel() for p in own))
    assert peak == max(per_module) and len(handed) == sum(n > 0 for n in per_module)
    assert sum(p.numel() for params in handed for p in params) == sum(per_module)
    assert (deferred.hf.lm_head.weight is deferred.hf.model.embed_tokens.weight) == tied
    for (name, expected), actual in zip(whole.state_dict().items(), deferred.state_dict().values(), strict=True):
        assert torch.equal(expected, actual), name  # parameters and buffers
    with torch.no_grad():
        assert torch.equal(deferred(tokens()), whole(tokens()))


def test_ranks_that_get_broadcast_values_read_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from disttrain.models import hf

    directory = save_tiny_model(tmp_path / "m")
    monkeypatch.setattr(hf.SafetensorsWeights, "get", lambda *_: pytest.fail("read the file"))
    deferred = build_hf_model(HFModelConfig(path=str(directory), seq_len=32), seed=0, placement="deferred")
    deferred.materialize_by_module(fill=False, partition=None)
    assert not deferred.deferred
    # DDP's other ranks: the structure with unset values, for the wrap-time broadcast to overwrite.
    monkeypatch.setattr(hf, "_rank", lambda: 1)
    other = build_hf_model(HFModelConfig(path=str(directory), seq_len=32), seed=0, placement="rank0")
    assert not other.deferred and {k: v.shape for k, v in other.state_dict().items()} == {
        k: v.shape for k, v in deferred.state_dict().items()
    }


def test_sharded_safetensors_are_read_tensor_by_tensor(tmp_path: Path) -> None:
    from disttrain.models.hf import SafetensorsWeights

    whole = build_hf_model(INLINE, seed=2)
    whole.hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="50KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    weights = SafetensorsWeights(tmp_path / "sharded")
    assert len(set(weights.files.values())) > 1
    for name, param in whole.hf.named_parameters():
        assert torch.equal(weights.get(name), param), name
