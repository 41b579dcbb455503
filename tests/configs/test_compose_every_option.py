"""Every option of every config group composes, parses, validates and builds its objects (no fitting)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from disttrain.config.parse import parse_run_config
from disttrain.config.schema import RunConfig
from disttrain.config.strategy_schema import MegatronConfig
from disttrain.config.validate import BatchPlan
from disttrain.job.describe import describe_launch
from disttrain.models import apply_activation_checkpointing
from disttrain.models.factory import model_facts
from disttrain.strategies.auto import resolve_auto
from disttrain.strategies.layout import parallel_layout, validate_run
from disttrain.strategies.megatron import MegatronStrategy
from disttrain.strategies.megatron.module import MegatronModule
from disttrain.strategies.registry import build_strategy, spec_of
from disttrain.training.build import build_datamodule, build_trainer
from disttrain.training.live_metrics import LiveMetrics
from tests.conftest import compose_train, group_options

GROUPS = ["model", "data", "strategy", "precision", "hw", "optimizer", "trainer", "logger", "diagnostics"]


def needs_for(group: str, option: str, tmp_path: Path) -> list[str]:
    """Companion overrides an option needs to be valid on its own."""
    if group == "data" and option == "text":
        text = tmp_path / "corpus.txt"
        text.write_text("hello distributed world\n" * 400)
        return [f"data.path={text}"]
    if group == "data" and option == "tokens":
        tokens = tmp_path / "train.bin"
        np.random.default_rng(0).integers(0, 256, 40_000, dtype=np.uint16).tofile(tokens)
        return [f"data.train_path={tokens}", "data.vocab_size=256"]
    if group == "model" and option == "hf":
        from tests.hf_fixtures import save_tiny_model

        return [f"model.path={save_tiny_model(tmp_path / 'tiny-llama')}"]
    if group == "data" and option == "hf":
        from tests.hf_fixtures import sentences, train_tokenizer, write_jsonl

        texts = sentences(300)
        tokenizer, corpus = train_tokenizer(tmp_path / "tok.json", texts), write_jsonl(tmp_path / "c.jsonl", texts)
        files = [f"data.train_files=[{corpus}]", f"data.tokenizer={tokenizer}", f"data.cache_dir={tmp_path}"]
        return ["model=hf-tiny-llama", *files]
    if group == "precision" and option == "fp16-mixed":
        return ["hw=1xa100"]
    if group == "precision" and option == "fp8":
        return ["hw=8xh100", "dry_run=true"]  # fp8 tensor cores: refused on CPU and A100s (test_fp8.py)
    if group == "hw" and option != "cpu":
        # Big enough global batches for 8-16 GPUs; dry runs only on this GPU-less machine.
        return ["dry_run=true"]
    return []


def expect_batch(run_cfg: RunConfig, plan: BatchPlan) -> None:
    """The batch plan against the config it came from: micro-batch, data-parallel size and global batch."""
    world = run_cfg.hw.world_size
    strategy = run_cfg.strategy
    model_parallel = strategy.tp * strategy.pp if isinstance(strategy, MegatronConfig) else 1
    assert (plan.micro_batch_size, plan.data_parallel_size) == (
        run_cfg.trainer.micro_batch_size,
        world // model_parallel,
    )
    rounds = strategy.num_microbatches if isinstance(strategy, MegatronConfig) else 1
    wanted = run_cfg.trainer.global_batch_size or plan.micro_batch_size * plan.data_parallel_size * rounds
    assert plan.global_batch_size == wanted and plan.accumulation == wanted // (
        plan.micro_batch_size * plan.data_parallel_size
    )


CASES = [(group, option) for group in GROUPS for option in group_options(group)]


def test_every_group_has_options() -> None:
    for group in GROUPS:
        assert group_options(group), f"conf/{group}/ is empty"
    assert set(group_options("model")) >= {
        "gpt-nano", "gpt2-124m", "gpt2-350m", "llama-1b", "llama-7b", "llama-13b", "llama-70b", "hf", "hf-tiny-llama",
        "hf-tiny-gpt2", "hf-tiny-mixtral",
    }  # fmt: skip
    assert set(group_options("hw")) >= {"cpu", "1xa100", "8xa100", "8xh100", "2x8xh100", "8xh200", "1xl4"}
    assert set(group_options("precision")) == {"fp32", "bf16-mixed", "bf16-true", "fp16-mixed", "fp8"}
    assert set(group_options("strategy")) >= {"ddp", "fsdp", "deepspeed", "megatron", "auto"}
    assert set(group_options("data")) == {"synthetic", "text", "tokens", "hf"}
    assert set(group_options("logger")) == {"csv", "wandb", "tensorboard"}


@pytest.mark.parametrize(("group", "option"), CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_option_composes_and_builds(group: str, option: str, tmp_path: Path) -> None:
    cfg = compose_train([f"{group}={option}", *needs_for(group, option, tmp_path)])
    run_cfg = parse_run_config(cfg)
    assert getattr(getattr(run_cfg, group), "name", option) == option
    if option == "auto":
        run_cfg, _ = resolve_auto(run_cfg, parallel_layout(run_cfg))
    parallel = parallel_layout(run_cfg)
    plan, layout = parallel.batch, parallel.world
    facts = model_facts(run_cfg.model, run_cfg.trainer.seed)
    text = describe_launch(run_cfg, parallel, facts)
    assert f"{facts.num_parameters:,} parameters" in text
    assert f"{plan.global_batch_size * run_cfg.model.seq_len:,} tokens/step" in text
    expect_batch(run_cfg, plan)

    strategy = build_strategy(run_cfg, layout.world_size, apply_activation_checkpointing)
    expected = {"fsdp": ModelParallelStrategy, "megatron": MegatronStrategy}.get(run_cfg.strategy.name, DDPStrategy)
    assert isinstance(strategy.strategy, expected)
    module = spec_of(run_cfg.strategy).build_module(run_cfg, plan.accumulation, strategy, facts)
    assert module.max_steps == run_cfg.trainer.max_steps
    if isinstance(run_cfg.strategy, MegatronConfig):
        assert isinstance(module, MegatronModule)
        # A Megatron step runs the pipeline schedule `rounds` times over num_microbatches micro-batches each.
        assert module.settings.rounds * run_cfg.strategy.num_microbatches == plan.accumulation
    else:
        assert module.model_factory is not None and module.accumulation == plan.accumulation
    datamodule = build_datamodule(run_cfg, plan)
    if run_cfg.hw.accelerator != "cpu":
        return  # a GPU Trainer cannot be constructed without CUDA; dry runs stop before it too
    if facts.num_parameters < 50_000_000:
        datamodule.setup("fit")
        x, y = datamodule.train_set[0]
        assert x.shape == y.shape == (run_cfg.model.seq_len,)
        assert int(y.max()) < run_cfg.model.vocab_size
    parts = build_trainer(run_cfg, parallel, strategy, tmp_path / "run", facts)
    assert parts.trainer.max_steps == run_cfg.trainer.max_steps
    # Megatron's loader batch is a whole step's micro-batches, which its engine splits itself.
    batches = 1 if run_cfg.strategy.name == "megatron" else plan.accumulation
    assert parts.trainer.accumulate_grad_batches == batches
    # The user's logger gets the diagnostics' figures only where diagnostics run: diagnostics=off logs nothing extra.
    live = [c for c in parts.trainer.callbacks if isinstance(c, LiveMetrics)]
    assert len(live) == (1 if run_cfg.diagnostics.enabled else 0)


@pytest.mark.parametrize("experiment", group_options("experiment"))
def test_experiment_recipes_validate(experiment: str) -> None:
    run_cfg = parse_run_config(compose_train([f"experiment={experiment}", "dry_run=true"]))
    expect_batch(run_cfg, validate_run(run_cfg))


def test_llama7b_recipe_layout() -> None:
    run_cfg = parse_run_config(compose_train(["experiment=llama7b-8xa100-fsdp"]))
    plan = validate_run(run_cfg)
    assert (run_cfg.model.name, run_cfg.hw.name, run_cfg.strategy.name) == ("llama-7b", "8xa100", "fsdp")
    assert (plan.micro_batch_size, plan.data_parallel_size, plan.accumulation) == (2, 8, 16)
