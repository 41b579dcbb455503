"""The memory refusal names overrides that fit, each with its predicted memory: applied, every one of them launches.

Drawn over models x hardware x strategies x micro-batches rather than a list of known cases: whatever a refusal
suggests must compose, validate, keep the global batch and fit; where it suggests nothing, nothing in reach fits.
"""

from __future__ import annotations

import itertools
import re

import pytest
from omegaconf import DictConfig

from disttrain.config.errors import ConfigError
from disttrain.config.parse import parse_run_config
from disttrain.config.schema import RunConfig
from disttrain.planner.plan import DEFAULT_ASSUMPTIONS, memory_limit
from disttrain.strategies.auto import check_fits, predicted_memory
from disttrain.strategies.layout import batch_plan
from disttrain.strategies.memory_fixes import recomputation, smaller_micro_batches
from tests.conftest import compose_train, with_plain_overrides

MODELS = ["llama-1b", "llama-7b", "mixtral-8x7b"]
HARDWARE = ["8xa100", "1xl4", "8xh100"]
STRATEGIES = [
    ["strategy=ddp"],
    ["strategy=fsdp"],
    ["strategy=deepspeed", "strategy.stage=2"],
    ["strategy=megatron", "strategy.tp=2"],
    ["strategy=megatron", "strategy.pp=2", "strategy.microbatches=2"],
]
FIX = re.compile(r"((?:[\w.]+=\S+ ?)+) \((\d+\.\d) GiB\)")


def refusal(composed: DictConfig) -> ConfigError | None:
    cfg = parse_run_config(composed)
    memory = predicted_memory(cfg)  # a layout this model refuses before memory raises here, not below
    try:
        check_fits(cfg, memory, check_memory=True)
    except ConfigError as err:
        return err
    return None


def cases() -> list[list[str]]:
    drawn = []
    for model, hw, strategy in itertools.product(MODELS, HARDWARE, STRATEGIES):
        if hw == "1xl4" and "strategy=megatron" in strategy:
            continue  # one GPU: no tp or pp of 2
        drawn.append([f"model={model}", f"hw={hw}", *strategy, "trainer.micro_batch_size=16", "precision=bf16-mixed"])
    return drawn


def limit(cfg: RunConfig) -> float:
    return memory_limit(cfg.hw, DEFAULT_ASSUMPTIONS.headroom)


def test_every_named_fix_fits_and_keeps_the_global_batch() -> None:
    refused = with_fix = 0
    for overrides in cases():
        composed = compose_train(overrides)
        try:
            err = refusal(composed)
        except ConfigError:
            continue  # a layout this model refuses before memory (e.g. tp not dividing the vocabulary)
        if err is None:
            continue
        refused += 1
        fixes = FIX.findall(err.fix)
        with_fix += bool(fixes)
        base = parse_run_config(composed)
        global_batch = batch_plan(base).global_batch_size
        for fix, gib in fixes:
            fixed = parse_run_config(with_plain_overrides(composed, fix.split()))
            memory = predicted_memory(fixed)
            assert memory is not None and f"{memory.total / 2**30:.1f}" == gib, (overrides, fix)
            assert memory.total <= limit(fixed), (overrides, fix)
            assert batch_plan(fixed).global_batch_size == global_batch, (overrides, fix)
        if not fixes:
            assert "no micro-batch or recomputation fits" in err.fix, err.fix
            # Nothing in reach fits: the strongest recomputation at micro-batch 1 still overflows.
            strongest = [o for _, o in recomputation(base.strategy)][-1:]
            least = [*strongest, "trainer.micro_batch_size=1", f"trainer.global_batch_size={global_batch}"]
            smallest = parse_run_config(with_plain_overrides(composed, least))
            assert predicted_memory(smallest).total > limit(smallest), overrides
    # The matrix holds both kinds of refusal, or it tests less than it says.
    assert refused >= 10 and 0 < with_fix < refused, (refused, with_fix)


def test_the_readme_example_is_refused_with_fixes_that_fit() -> None:
    err = refusal(compose_train(["strategy=fsdp", "hw=8xa100", "model=llama-1b"]))
    assert err is not None and err.key == "strategy"
    assert re.search(r"strategy\.activation_checkpointing=true \(\d+\.\d GiB\)", err.fix)
    assert re.search(r"trainer\.micro_batch_size=\d+ trainer\.global_batch_size=128 \(\d+\.\d GiB\)", err.fix)


def test_megatron_recomputation_escalates_from_selective_to_full() -> None:
    base = parse_run_config(compose_train(["strategy=megatron", "strategy.tp=2", "hw=8xa100", "model=llama-7b"]))
    assert [o for _, o in recomputation(base.strategy)] == [
        "strategy.activation_checkpointing=selective",
        "strategy.activation_checkpointing=full",
    ]
    assert recomputation(parse_run_config(compose_train(["strategy=ddp"])).strategy) == []


@pytest.mark.parametrize("global_batch", [None, 64])
def test_a_smaller_micro_batch_pins_the_global_batch_only_when_the_user_left_it_free(global_batch: int | None) -> None:
    extra = [] if global_batch is None else [f"trainer.global_batch_size={global_batch}"]
    cfg = parse_run_config(compose_train(["hw=8xa100", "model=llama-1b", "trainer.micro_batch_size=8", *extra]))
    options = smaller_micro_batches(cfg, batch_plan(cfg).global_batch_size)
    assert [v.trainer.micro_batch_size for v, _ in options] == list(range(7, 0, -1))
    pinned = [o for _, o in options if "global_batch_size" in o]
    assert len(pinned) == (7 if global_batch is None else 0)
