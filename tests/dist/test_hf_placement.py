"""model=hf starts where each strategy wants it, on 2 gloo ranks, with bitwise the weights one process builds.

ZeRO-3 builds the model partitioned: one module at a time gets storage, rank 0's values, and is partitioned before
the next (no rank ever holds more than one module's parameters whole); FSDP2 materializes only each rank's
shards after ``fully_shard``; with ``model.path`` only rank 0 reads the file (ZeRO-3 and FSDP2 broadcast tensor by
tensor; DDP and ZeRO-1/2 broadcast rank 0's parameters when they wrap the model, so the other ranks build only
the structure). The CLI runs (test_hf_parity.py) cannot see who read what or the
weights before the first step, so this one spawn builds every case as ``configure_model`` does: the cases take a
few seconds, the ranks' imports (deepspeed, transformers) most of the ~18 s the module takes on a quiet box.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open

from disttrain.config.schema import HFModelConfig
from disttrain.models.hf import build_hf_model
from tests.dist.hf_placement_worker import worker
from tests.hf_fixtures import TINY_LLAMA, save_tiny_model

pytestmark = pytest.mark.dist

WORLD = 2
TIED = {**TINY_LLAMA, "tie_word_embeddings": True}
WRAPPERS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict], dict[str, list[dict]]]:
    tmp = tmp_path_factory.mktemp("placement")
    untied, tied = save_tiny_model(tmp / "untied", TINY_LLAMA), save_tiny_model(tmp / "tied", TIED)
    cases = {
        "zero3-init": {"strategy": "zero3", "model": {"config": TINY_LLAMA}},
        "zero3-path": {"strategy": "zero3", "model": {"path": str(tied)}},
        "fsdp-init": {"strategy": "fsdp", "model": {"config": TIED}},
        "fsdp-path": {"strategy": "fsdp", "model": {"path": str(untied)}},
        "ddp-path": {"strategy": "ddp", "model": {"path": str(untied)}},
        "zero2-init": {"strategy": "zero2", "model": {"config": TIED}},
    }
    mp.spawn(worker, args=(WORLD, _free_port(), json.dumps(cases), str(tmp)), nprocs=WORLD, join=True)
    records = {
        case: [torch.load(tmp / f"rank{r}-{case}.pt", weights_only=False) for r in range(WORLD)] for case in cases
    }
    return cases, records


def one_process(spec: dict) -> dict[str, torch.Tensor]:
    """Today's single-process build: from_pretrained, or the deterministic init with the worker's seed."""
    return dict(build_hf_model(HFModelConfig(seq_len=32, **spec["model"]), seed=5).named_parameters())


def clean(name: str) -> str:
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


@pytest.mark.parametrize("case", ["zero3-init", "zero3-path", "fsdp-init", "fsdp-path", "ddp-path", "zero2-init"])
def test_every_rank_starts_from_the_one_process_weights(case: str, built: tuple) -> None:
    cases, records = built
    expected = one_process(cases[case])
    for rank, record in enumerate(records[case]):
        got = {clean(name): value for name, value in record["params"].items()}
        assert sorted(got) == sorted(expected), rank
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"{case} rank {rank}: {name}"


@pytest.mark.parametrize("case", ["zero3-init", "zero3-path"])
def test_zero3_never_holds_more_than_one_module_whole(case: str, built: tuple) -> None:
    cases, records = built
    model = build_hf_model(HFModelConfig(seq_len=32, **cases[case]["model"]), seed=5)
    unique = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in unique)
    largest_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    for record in records[case]:
        assert record["peak"] == largest_module < total / 5  # the embedding (or head) alone
        assert record["whole_left"] == []
        # Its own slice of every parameter: half of each, rounded up.
        assert record["held"] == sum(-(-p.numel() // WORLD) for p in unique)


def test_fsdp_ranks_hold_their_shards_only(built: tuple) -> None:
    cases, records = built
    for case in ("fsdp-init", "fsdp-path"):
        total = sum(p.numel() for p in one_process(cases[case]).values())  # named once: a tied head counts once
        assert sum(r["held"] for r in records[case]) == total
        assert all(r["held"] < total for r in records[case])


@pytest.mark.parametrize("case", ["zero3-path", "fsdp-path", "ddp-path"])
def test_only_rank_zero_reads_model_path(case: str, built: tuple) -> None:
    cases, records = built
    rank0, rank1 = records[case]
    assert rank1["reads"] == [] and rank1["loads"] == []
    if case == "ddp-path":  # rank 0 loads as one process does; DDP broadcasts its parameters at wrap time
        assert rank0["loads"] == [cases[case]["model"]["path"]] and rank0["reads"] == []
        return
    with safe_open(str(Path(cases[case]["model"]["path"]) / "model.safetensors"), framework="pt") as handle:
        stored = sorted(handle.keys())
    assert rank0["loads"] == [] and sorted(rank0["reads"]) == stored  # each tensor once
