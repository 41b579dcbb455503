"""A resume reads its data with the tokenizer the checkpoint was trained with (refused before launch otherwise)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from diagnostics.manifest import RunManifest
from disttrain.checkpoint.resume import ResumePoint
from disttrain.config.errors import ConfigError
from disttrain.config.schema import HFDataConfig
from disttrain.data.hf import tokenizer_sha256
from disttrain.job.prepare import check_resumed_tokenizer
from tests.hf_fixtures import sentences, train_tokenizer


def _resume_from(tmp_path: Path, recorded_tokenizer: Path) -> ResumePoint:
    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / "step000010.ckpt"
    checkpoint.mkdir(parents=True)
    RunManifest(config={"data": {"name": "hf"}}, tokenizer_sha256=tokenizer_sha256(str(recorded_tokenizer))).write(
        run_dir
    )
    return ResumePoint(checkpoint)


def _run_with(tokenizer: Path) -> SimpleNamespace:
    return SimpleNamespace(data=HFDataConfig(train_files=["corpus.jsonl"], tokenizer=str(tokenizer)))


def test_another_tokenizer_of_the_same_size_is_refused_with_the_key(tmp_path: Path) -> None:
    original = train_tokenizer(tmp_path / "a.json", sentences(200, seed=0))
    other = train_tokenizer(tmp_path / "b.json", sentences(200, seed=1))  # same vocabulary size, other merges
    point = _resume_from(tmp_path, original)
    with pytest.raises(ConfigError) as err:
        check_resumed_tokenizer(point, _run_with(other))  # type: ignore[arg-type]
    assert err.value.key == "data.tokenizer" and "trained with" in str(err.value)
    check_resumed_tokenizer(point, _run_with(original))  # type: ignore[arg-type]  # the same files: resumes


def test_a_run_that_recorded_no_tokenizer_is_not_refused(tmp_path: Path) -> None:
    tokenizer = train_tokenizer(tmp_path / "a.json", sentences(200))
    run_dir = tmp_path / "old"
    checkpoint = run_dir / "checkpoints" / "step000010.ckpt"
    checkpoint.mkdir(parents=True)
    RunManifest(config={"data": {"name": "hf"}}).write(run_dir)  # written before tokenizers were recorded
    check_resumed_tokenizer(ResumePoint(checkpoint), _run_with(tokenizer))  # type: ignore[arg-type]
