"""A run stopped by a full disk is said as that (job/disk_full.py): the error names ENOSPC and the run dir's
filesystem has next to nothing free; an injected ENOSPC on a disk with room stays the crash it is."""

from __future__ import annotations

import errno
import os
from collections import namedtuple
from pathlib import Path

import pytest

from disttrain.job import disk_full
from disttrain.job.disk_full import disk_full_failure

Usage = namedtuple("Usage", "total used free")
GIB = 1024**3


def checkpoint_failed() -> BaseException:
    """DCP's aggregate over the ranks, raised while handling the rank's own OSError (as a real save chains them)."""
    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as own:
            raise RuntimeError("CheckpointException ranks:dict_keys([0, 1])") from own
    except RuntimeError as err:
        return err


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "checkpoints" / ".partial-step000040").mkdir(parents=True)
    return tmp_path


def test_a_full_disk_is_named_with_the_step_being_written_and_how_to_go_on(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_full.shutil, "disk_usage", lambda path: Usage(100 * GIB, 100 * GIB - 2**20, 2**20))
    line = disk_full_failure(checkpoint_failed(), run_dir)
    assert line == (
        f"disk full writing the checkpoint of step 40 under {run_dir / 'checkpoints'} (1 MiB free); no complete "
        f"checkpoint is kept: free space or move the run dir, then python -m train resume={run_dir}"
    )


def test_an_enospc_on_a_disk_with_room_or_another_error_is_not_a_full_disk(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(disk_full.shutil, "disk_usage", lambda path: Usage(100 * GIB, 50 * GIB, 50 * GIB))
    assert disk_full_failure(checkpoint_failed(), run_dir) is None  # the fault injector's, or a quota that lifted
    monkeypatch.setattr(disk_full.shutil, "disk_usage", lambda path: Usage(100 * GIB, 100 * GIB, 0))
    assert disk_full_failure(ValueError("loss is nan"), run_dir) is None
    assert disk_full_failure(None, run_dir) is None
