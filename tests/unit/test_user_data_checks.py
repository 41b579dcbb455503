"""A user's ``data._target_`` is held to the contract the loss and the accounting read: its class is found and its
call bound before launch, its first training and validation batches checked on the ranks, and what is wrong said
once, as a config error (run.json and failure.json record it)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from diagnostics.crash import write_crash_record
from diagnostics.manifest import RunManifest
from disttrain.config.errors import ConfigError
from disttrain.config.schema import CustomDataConfig
from disttrain.data.batch_check import UserBatchCheck, batch_problem
from disttrain.data.user_datamodule import check_user_datamodule
from disttrain.job.failure import FailureReporting, stop_for_failure

SEQ, MICRO, VOCAB = 8, 4, 16


def pair(rows: int = MICRO, seq: int = SEQ, low: int = 0, high: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows * 1000 + seq)
    inputs = torch.randint(low, high, (rows, seq), generator=generator)
    return inputs, torch.roll(inputs, -1, dims=1)


@pytest.mark.parametrize(
    ("rows", "dtype", "as_list"), list(itertools.product([1, MICRO], [torch.int64, torch.int32], [False, True]))
)
def test_every_well_formed_batch_passes(rows: int, dtype: torch.dtype, as_list: bool) -> None:
    inputs, targets = pair(rows)
    inputs = inputs.to(dtype)  # the embedding takes int32 ids too; the loss wants int64 targets
    targets[0, -1] = -100  # padding the loss ignores
    batch = [inputs, targets] if as_list else (inputs, targets)
    assert batch_problem(batch, SEQ, MICRO, VOCAB) is None


def wrong(kind: str) -> object:
    inputs, targets = pair()
    return {
        "dict": {"input_ids": inputs, "labels": targets},
        "single tensor": inputs,
        "triple": (inputs, targets, targets),
        "floats": (inputs.float(), targets),
        "bools": (inputs, targets > 3),
        "int32 targets": (inputs, targets.int()),
        "uint8 inputs": (inputs.to(torch.uint8), targets),
        "lists": (inputs.tolist(), targets),
        "3-d": (inputs[..., None], targets[..., None]),
        "mismatch": (inputs, targets[:, :-1]),
        "short": pair(seq=SEQ // 2),
        "too many rows": pair(rows=MICRO * 2),
        "ids past the vocab": pair(high=VOCAB + 5),
        "negative ids": pair(low=-3),
        "targets past the vocab": (inputs, targets + VOCAB),
    }[kind]


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("dict", "is a dict (keys input_ids, labels), not an (inputs, targets) pair"),
        ("single tensor", "is a [4, 8] int64 tensor, not an (inputs, targets) pair"),
        ("triple", "is a tuple, not an (inputs, targets) pair"),
        ("floats", "holds a [4, 8] float32 tensor as its inputs, not token ids (int64 or int32)"),
        ("int32 targets", "holds a [4, 8] int32 tensor as its targets, not token ids (int64)"),
        ("uint8 inputs", "holds a [4, 8] uint8 tensor as its inputs, not token ids"),
        ("bools", "holds a [4, 8] bool tensor as its targets, not token ids"),
        ("lists", "holds a list as its inputs, not a tensor"),
        ("3-d", "holds inputs [4, 8, 1] and targets [4, 8, 1], not two [batch, seq] tensors"),
        ("mismatch", "holds inputs [4, 8] and targets [4, 7]"),
        ("short", "has sequences of 4 tokens, not model.seq_len=8"),
        ("too many rows", "has 8 rows, more than the micro-batch of 4"),
        ("ids past the vocab", "input ids in [0, "),
        ("negative ids", "input ids in [-"),
        ("targets past the vocab", "target ids in [16, "),
    ],
)
def test_each_way_a_batch_can_be_wrong_is_named(kind: str, said: str) -> None:
    problem = batch_problem(wrong(kind), SEQ, MICRO, VOCAB)
    assert problem is not None and said in problem


def test_the_callback_checks_the_first_batch_of_each_loader_only() -> None:
    check = UserBatchCheck(SEQ, MICRO, VOCAB)
    check.on_train_batch_start(None, None, pair(), 0)  # type: ignore[arg-type]
    check.on_train_batch_start(None, None, wrong("dict"), 1)  # type: ignore[arg-type]  # not looked at again
    with pytest.raises(ConfigError) as info:
        check.on_validation_batch_start(None, None, wrong("short"), 0)  # type: ignore[arg-type]
    assert info.value.key == "data._target_" and info.value.problem.startswith("the first validation batch has")


class TakesKwargs:
    def __init__(self, **kwargs: object) -> None:
        pass


class Strict:
    def __init__(self, seq_len: int, micro_batch_size: int, path: str) -> None:
        pass


@pytest.mark.parametrize(
    ("target", "kwargs", "said"),
    [
        (f"{__name__}.Strict", {"path": "x"}, None),
        (f"{__name__}.TakesKwargs", {"anything": 1}, None),
        (f"{__name__}.Strict", {}, "missing a required argument: 'path'"),
        (f"{__name__}.Strict", {"path": "x", "shuffle": True}, "unexpected keyword argument 'shuffle'"),
        ("tests.plugins.CountingData", {"modulus": 7}, None),
        ("tests.plugin.CountingData", {}, "'tests' has no 'plugin'"),
        (f"{__name__}.SEQ", {}, "'tests.unit.test_user_data_checks.SEQ' is a int"),
    ],
)
def test_the_datamodule_call_is_bound_before_launch(target: str, kwargs: dict, said: str | None) -> None:
    data = CustomDataConfig(target=target, kwargs=kwargs)
    if said is None:
        check_user_datamodule(data, MICRO, SEQ)
        return
    with pytest.raises(ConfigError) as info:
        check_user_datamodule(data, MICRO, SEQ)
    assert info.value.key == "data._target_" and said in info.value.problem


def test_a_config_error_a_rank_raised_is_the_runs_failure_said_once_with_exit_code_2(tmp_path: Path) -> None:
    long_fix = "yield (inputs, targets) pairs " + "x" * 400  # longer than a crash record's first-line cut
    raised = ConfigError("data._target_", "the first training batch is a dict (keys input_ids)", long_fix)
    write_crash_record(tmp_path, 1, raised, step=1, phase="forward")
    manifest = RunManifest(command=["python", "-m", "train"], config={})
    manifest.write(tmp_path)
    peer = RuntimeError("Connection closed by peer")  # what rank 0 saw of it
    stop = stop_for_failure(FailureReporting(tmp_path, manifest, report=True, reports=True), None, None, peer)
    assert stop.exit_code == 2
    assert stop.message == f"disttrain: config error: {raised}"
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["status"] == "failed" and run["failure"] == f"rank 1: config error: {raised}"
    failure = json.loads((tmp_path / "failure.json").read_text())
    assert failure == {"error": f"config error: {raised}", "source": "rank 1", "rank": 1, "traceback": ""}
    assert not (tmp_path / "report").exists()  # a config error has nothing to diagnose
