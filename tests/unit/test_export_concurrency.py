"""Exports of one checkpoint to one file at once (checkpoint/export.py): one writes it, the others are refused,
and the file is whole (a hard link is the exclusive create of the final name)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from disttrain.checkpoint import export
from disttrain.checkpoint.export import export_state_dict


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "step000003.ckpt"
    torch.save({"state_dict": {"model.w": torch.arange(6.0), "model.b": torch.ones(2)}, "global_step": 3}, path)
    return path


def test_an_export_never_writes_over_a_file_made_while_it_wrote(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "export" / "step000003.pt"
    save = torch.save

    def another_export_finishes_first(obj: object, path: Path) -> None:
        save(obj, path)
        out.write_bytes(b"the other export's file")

    monkeypatch.setattr(export.torch, "save", another_export_finishes_first)
    with pytest.raises(FileExistsError):
        export_state_dict(checkpoint, out)
    assert out.read_bytes() == b"the other export's file"
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no partial file left behind


def _export(
    checkpoint: str, out: str, barrier: multiprocessing.synchronize.Barrier, results: multiprocessing.Queue
) -> None:
    barrier.wait()
    try:
        export_state_dict(Path(checkpoint), Path(out))
        results.put("wrote")
    except FileExistsError:
        results.put("refused")


def test_of_exports_to_one_file_at_once_one_writes_it_whole(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "export" / "step000003.pt"
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_export, args=(str(checkpoint), str(out), barrier, results)) for _ in range(4)]
    for proc in procs:
        proc.start()
    outcomes = sorted(results.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    assert outcomes == ["refused"] * 3 + ["wrote"]
    weights = torch.load(out, weights_only=True)
    assert torch.equal(weights["w"], torch.arange(6.0)) and torch.equal(weights["b"], torch.ones(2))
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]
