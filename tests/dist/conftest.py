"""Runs shared across the multi-process test files: each launch here feeds the assertions of several files."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from tests.dist.test_diagnostics_runs import SHORT, SLEEP_S, USER_MODEL


@dataclass(frozen=True)
class FinishedRun:
    run_dir: Path
    console: str  # stdout + stderr
    metrics: list[dict[str, str]]  # metrics/metrics.csv, row by row


@pytest.fixture(scope="session")
def sleepy_rank_run(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """A user's own model and datamodule by ``_target_`` (SleepyRankModel, a BigramModel whose rank 1 sleeps in
    forward, over CountingData) on 2 ranks with the CSV logger: a straggler DDP hides. One launch serves the
    diagnosis of the straggler, the logger's live metrics and the plug-in path, all in test_diagnostics_runs.py (one
    file: xdist gives a file to one worker, and two workers would each launch it)."""
    run_dir = tmp_path_factory.mktemp("sleepy") / "run"
    args = [*SHORT, "trainer.max_steps=30", "trainer.val_every_n_steps=30", *USER_MODEL,
            "+model._target_=tests.plugins.SleepyRankModel", f"+model.sleep_s={SLEEP_S}"]  # fmt: skip
    result = run_cli([*args, f"hydra.run.dir={run_dir}"], cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with (run_dir / "metrics" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    return FinishedRun(run_dir, result.stdout + result.stderr, rows)
