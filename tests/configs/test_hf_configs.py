"""model=hf and data=hf: compose, parse and validate against locally built models, tokenizers and corpora; the
planner reads the HF shape; every bad input is one ConfigError naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from disttrain.config.errors import ConfigError
from disttrain.config.hf import hf_shape
from disttrain.config.parse import parse_run_config
from disttrain.config.schema import HFDataConfig, HFModelConfig
from disttrain.data.corpus_check import tokenize_corpus
from disttrain.data.hf import LocalTokenizer, prepare_corpus
from disttrain.models.accounting import count_parameters
from disttrain.models.factory import model_facts
from disttrain.planner import Workload, model_shape
from disttrain.planner.memory import activation_bytes, layer_activation_bytes
from disttrain.strategies.layout import validate_run
from disttrain.strategies.registry import spec_of
from pipelines.plan import plan_from_config
from tests.configs.test_plan_cli import compose_plan
from tests.conftest import compose_train
from tests.hf_fixtures import TINY_LLAMA, save_tiny_model, sentences, train_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    texts = sentences(300)
    return {
        "model": save_tiny_model(root / "tiny-llama"),
        "tokenizer": train_tokenizer(root / "tokenizer.json", texts),
        "train": write_jsonl(root / "train.jsonl", texts),
        "root": root,
    }


def data_args(local: dict[str, Path], cache: Path) -> list[str]:
    return ["data=hf", f"data.train_files=[{local['train']}]", f"data.tokenizer={local['tokenizer']}",
            f"data.cache_dir={cache}"]  # fmt: skip


def validated(overrides: list[str]):
    """Validation, then prepare's corpus step (data=hf: tokenized and checked against the model)."""
    run_cfg = parse_run_config(compose_train(overrides))
    plan = validate_run(run_cfg)
    tokenize_corpus(run_cfg)
    return run_cfg, plan


def error_of(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        validated(overrides)
    return caught.value


def test_model_path_facts_match_the_real_model(local: dict[str, Path]) -> None:
    run_cfg, _ = validated(["model=hf", f"model.path={local['model']}", "model.seq_len=64"])
    assert isinstance(run_cfg.model, HFModelConfig)
    shape = hf_shape(run_cfg.model)
    want = (2, 64, 4, 2, 176, 320, False, 16)
    got = (shape.n_layers, shape.d_model, shape.n_heads, shape.kv_heads, shape.ffn_hidden, shape.vocab_size,
           shape.tie_embeddings, shape.head_dim)  # fmt: skip
    assert got == want and (shape.norm, shape.mlp, shape.pos_emb) == ("rmsnorm", "swiglu", "rope")
    from transformers import AutoModelForCausalLM

    real = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(local["model"])).parameters())
    # The facts count the real module; the planner's analytic shape counts the same tensors.
    assert model_facts(run_cfg.model, 0).num_parameters == count_parameters(shape) == real


@pytest.mark.parametrize("option", ["hf-tiny-llama", "hf-tiny-gpt2"])
def test_inline_configs_compose_and_count(option: str) -> None:
    run_cfg, _ = validated([f"model={option}"])
    facts = model_facts(run_cfg.model, 0)
    shape = hf_shape(run_cfg.model)
    assert shape.vocab_size == run_cfg.model.vocab_size == 512
    assert facts.num_parameters == count_parameters(shape)  # GPT-2's 1024 learned position rows included


def test_plan_cli_reads_the_hf_config(local: dict[str, Path]) -> None:
    result = plan_from_config(compose_plan(["model=hf", f"model.path={local['model']}", "hw=8xa100"]))
    assert result.shape.num_parameters == count_parameters(hf_shape(HFModelConfig(path=str(local["model"]))))
    assert result.candidates and result.recommended is not None


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model=hf", "model.path=/nonexistent/model"], "model.path"),
        (["model=hf", "model.path=null"], "model.path"),  # neither a path nor a config
        (["model=hf-tiny-llama", "model.config.model_type=nosuchmodel"], "model.config"),
        (["model=hf-tiny-gpt2", "model.seq_len=2048"], "model.seq_len"),
        (["model=hf-tiny-gpt2", "strategy=megatron", "strategy.tp=2"], "strategy"),  # GPT-2 has no TP plan
        (
            ["model=hf-tiny-llama", "strategy=megatron", "strategy.pp=2", "strategy.virtual_stages=2"],
            "strategy.virtual_stages",
        ),
        (
            ["model=hf-tiny-llama", "strategy=megatron", "strategy.pp=2", "strategy.schedule=zero_bubble"],
            "strategy.schedule",
        ),
        (
            ["model=hf-tiny-llama", "strategy=megatron", "strategy.pp=3", "hw.devices_per_node=3"],
            "strategy.pp",
        ),  # 4 layers in 3 stages
        # Vocab-parallel embedding and head: tp must divide the vocabulary.
        (["model=hf-tiny-llama", "strategy=megatron", "strategy.tp=2", "model.config.vocab_size=511"], "strategy.tp"),
        # Sequence parallel needs a whole sequence slice per tp rank.
        (
            [
                "model=hf-tiny-llama",
                "strategy=megatron",
                "strategy.tp=2",
                "strategy.sequence_parallel=true",
                "model.seq_len=33",
            ],
            "strategy.sequence_parallel",
        ),
        # Gemma-2's layers hold two more norms than the Llama layout: they would train wrong on sequence slices.
        (
            [
                "model=hf-tiny-llama",
                "model.config.model_type=gemma2",
                "strategy=megatron",
                "strategy.tp=2",
                "strategy.sequence_parallel=true",
            ],
            "strategy.sequence_parallel",
        ),
        (["model=hf-tiny-llama", "strategy=megatron", "strategy.tp=4", "hw.devices_per_node=4"], "strategy.tp"),
        (["model=hf-tiny-llama", "model.attn_implementation=flash"], "model.attn_implementation"),
    ],
)
def test_bad_model_inputs(overrides: list[str], key: str) -> None:
    err = error_of(overrides)
    assert err.key == key and "\n" not in str(err)


def test_megatron_tp_for_a_llama_family_model_validates() -> None:
    run_cfg, plan = validated(["model=hf-tiny-llama", "strategy=megatron", "strategy.tp=2"])
    assert (run_cfg.strategy.tp, plan.data_parallel_size) == (2, 1)
    # Pipeline stages by decoder layer, with TP inside each stage.
    run_cfg, plan = validated(
        ["model=hf-tiny-llama", "strategy=megatron", "strategy.tp=2", "strategy.pp=2", "hw.devices_per_node=4"]
    )
    assert (run_cfg.strategy.tp, run_cfg.strategy.pp, plan.data_parallel_size) == (2, 2, 1)
    # With sequence parallelism, which the planner then counts: the norms' and projections' inputs (the
    # replicated part of a layer's activations) on half the sequence per tp rank.
    sp = ["model=hf-tiny-llama", "strategy=megatron", "strategy.tp=2", "strategy.pp=2", "hw.devices_per_node=4"]
    on, _ = validated([*sp, "strategy.sequence_parallel=true"])
    off, _ = validated(sp)
    layout_on, layout_off = (spec_of(c.strategy).planner_layout(1, 2) for c in (on, off))
    assert layout_on.sequence_parallel and not layout_off.sequence_parallel
    shape, workload = model_shape(hf_shape(on.model)), Workload(4, 8, 128, "fp32")
    per_layer = {
        sp: layer_activation_bytes(shape, 4, 128, act_bytes=4, res_bytes=4, tp=2, sequence_parallel=sp)
        for sp in (True, False)
    }
    # fp32: two residual-stream inputs, two projection inputs (4 x 4 bytes), two RMSNorm statistics (2 x 4 bytes)
    # per token of 128 hidden; SP keeps half of them.
    tokens, hidden = 4 * 128, 128
    assert per_layer[False] - per_layer[True] == pytest.approx((16 * hidden + 8) * tokens / 2)
    first_stage = {
        lay.sequence_parallel: activation_bytes(shape, lay, workload, 0, True) for lay in (layout_on, layout_off)
    }
    # Stage 0 of 1F1B holds 2 micro-batches of its 2 layers.
    assert first_stage[False] - first_stage[True] == pytest.approx(2 * 2 * (per_layer[False] - per_layer[True]))
    # Selective recomputation of the attention kernel, with SP or without.
    for extra in ([], ["strategy.sequence_parallel=true"]):
        run_cfg, _ = validated([*sp, *extra, "strategy.activation_checkpointing=selective"])
        assert run_cfg.strategy.activation_checkpointing == "selective"
    # Without it, Gemma-2 (extra norms in its layers) is still tensor parallel.
    gemma2 = ["model.config.model_type=gemma2"]
    run_cfg, _ = validated(["model=hf-tiny-llama", *gemma2, "strategy=megatron", "strategy.tp=2"])
    assert run_cfg.strategy.tp == 2


def test_corpus_is_tokenized_once_and_joined_with_eos(local: dict[str, Path], tmp_path: Path) -> None:
    cfg = HFDataConfig(train_files=[str(local["train"])], tokenizer=str(local["tokenizer"]), cache_dir=str(tmp_path))
    corpus = prepare_corpus(cfg)
    tokenizer = LocalTokenizer(str(local["tokenizer"]), None)
    docs = [json.loads(line)["text"] for line in local["train"].read_text().splitlines()]
    expected = [t for ids in tokenizer.encode(docs) for t in (*ids, tokenizer.eos_id)]
    assert corpus.open().tolist() == expected and corpus.dtype == "uint16"
    stamp = corpus.train.stat().st_mtime_ns
    again = prepare_corpus(cfg)  # a later run (or another rank): a cache hit, nothing rewritten
    assert again.train == corpus.train and again.train.stat().st_mtime_ns == stamp
    other = prepare_corpus(HFDataConfig(**{**cfg.__dict__, "format": "json"}))
    assert other.train != corpus.train  # another setting is another cache entry


@pytest.mark.parametrize("kind", ["parquet", "csv", "txt", "disk"])
def test_every_file_format_gives_the_same_stream(kind: str, local: dict[str, Path], tmp_path: Path) -> None:
    import datasets

    texts = [json.loads(line)["text"] for line in local["train"].read_text().splitlines()]
    table = datasets.Dataset.from_dict({"text": texts})
    target = tmp_path / f"corpus.{kind}"
    {"parquet": table.to_parquet, "csv": table.to_csv, "disk": table.save_to_disk}.get(
        kind, lambda p: Path(p).write_text("\n".join(texts) + "\n")
    )(str(target))
    base = {"tokenizer": str(local["tokenizer"]), "cache_dir": str(tmp_path / "cache")}
    got = prepare_corpus(HFDataConfig(train_files=[str(target)], **base)).open().tolist()
    want = prepare_corpus(HFDataConfig(train_files=[str(local["train"])], **base)).open().tolist()
    assert got == want


def test_data_hf_composes_splits_and_validates(local: dict[str, Path], tmp_path: Path) -> None:
    run_cfg, _ = validated(["model=hf-tiny-llama", "model.seq_len=32", *data_args(local, tmp_path)])
    from disttrain.data.datamodule import TokenDataModule

    module = TokenDataModule(run_cfg.data, 32, 4, 8, seed=0)
    module.setup("fit")
    x, y = module.train_set[0]
    assert x.shape == y.shape == (32,) and int(x.max()) < 300 and torch_equal_shift(module)
    # One path where a list is expected is accepted as that list.
    single, _ = validated(["model=hf-tiny-llama", *data_args(local, tmp_path), f"data.train_files={local['train']}"])
    assert single.data.train_files == [str(local["train"])]


def torch_equal_shift(module) -> bool:
    x, y = module.train_set[3]
    return bool((x[1:] == y[:-1]).all())


def test_bad_data_inputs(local: dict[str, Path], tmp_path: Path) -> None:
    base = ["model=hf-tiny-llama", "model.seq_len=32", *data_args(local, tmp_path / "cache")]
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", ""])
    cases = {
        "data.train_files": [f"data.train_files=[{tmp_path / 'missing.jsonl'}]"],
        "data.text_column": ["data.text_column=body"],
        "data.text_column ": ["data.text_column=id"],  # a number column, not text
        "data.tokenizer": ["model.config.vocab_size=128"],  # the tokenizer has 300 ids
        "data.format": [f"data.train_files=[{local['model'] / 'config.json'}]", "data.format=pdf"],
        "data.eos_token": ["data.eos_token='<nope>'"],
    }
    for key, extra in cases.items():
        err = error_of([*base, *extra])
        assert err.key == key.strip() and "\n" not in str(err), (key, str(err))
    err = error_of([*base, f"data.train_files=[{empty}]"])
    assert err.key == "data.train_files" and "empty corpus" in str(err)
    assert "fix" in str(error_of([*base, "model.config.vocab_size=128"])).lower()
    short = write_jsonl(tmp_path / "short.jsonl", ["the model"])
    assert error_of([*base, f"data.train_files=[{short}]"]).key == "data.val_fraction"
    # Nothing half-written is left in the cache by the failures.
    assert not list((tmp_path / "cache").glob("*.tmp"))
    assert np.all([p.suffix == ".bin" for p in (tmp_path / "cache").iterdir()])


@pytest.mark.parametrize("seq_len", [64, 128])
def test_gpt2_learned_positions_are_counted_at_the_models_own_rows(seq_len: int) -> None:
    # GPT-2 holds n_positions (1024) position rows whatever seq_len a run uses; the planner counts what it holds.
    from disttrain.models.hf import build_hf_model
    from disttrain.planner.shapes import model_shape

    run_cfg, _ = validated(["model=hf-tiny-gpt2", f"model.seq_len={seq_len}"])
    shape = hf_shape(run_cfg.model)
    real = sum(p.numel() for p in build_hf_model(run_cfg.model, seed=0, device="meta").parameters())
    assert shape.learned_position_rows == 1024
    assert count_parameters(shape) == real == model_facts(run_cfg.model, 0).num_parameters
    assert model_shape(shape).num_parameters == real


def test_a_position_table_size_is_refused_for_the_reference_model() -> None:
    err = error_of(["model.position_rows=1024"])
    assert err.key == "model.position_rows" and "\n" not in str(err)


def test_model_path_weights_are_checked_before_launch(local: dict[str, Path], tmp_path: Path) -> None:
    """Ranks that receive the weights tensor by tensor cannot fall back on random values: a directory without
    safetensors, or with weights for another shape, is one error naming model.path."""
    import shutil

    bare = tmp_path / "config-only"
    bare.mkdir()
    shutil.copy(local["model"] / "config.json", bare / "config.json")
    err = error_of(["model=hf", f"model.path={bare}"])
    assert err.key == "model.path" and "no model.safetensors" in str(err) and "\n" not in str(err)
    # The saved weights of a wider model under this config.json: every matrix has another shape.
    wider = save_tiny_model(tmp_path / "wider", {**TINY_LLAMA, "hidden_size": 128, "intermediate_size": 256})
    shutil.copy(local["model"] / "config.json", wider / "config.json")
    err = error_of(["model=hf", f"model.path={wider}"])
    assert err.key == "model.path" and "lacks 21 of the 21 weights" in str(err), str(err)
    assert "model.embed_tokens.weight: shape [320, 128], expected [320, 64]" in str(err) and "\n" not in str(err)
