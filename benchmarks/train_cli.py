"""Shared by the benchmarks: run ``python -m train`` into a throw-away run dir, and the spread of repeats."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def train_manifest(overrides: list[str], inspect: Callable[[Path], None] | None = None) -> dict:
    """The run's run.json; ``inspect`` may read the run dir before it is deleted."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        subprocess.run(
            [sys.executable, "-m", "train", *overrides, f"hydra.run.dir={run_dir}"],
            check=True,
            cwd=tmp,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        if inspect is not None:
            inspect(run_dir)
        return json.loads((run_dir / "run.json").read_text())


def spread(values: list[float]) -> str:
    """Min and max as percentages off the median of repeated measurements."""
    mid = statistics.median(values)
    return f"{100 * (min(values) / mid - 1):+.1f}%/{100 * (max(values) / mid - 1):+.1f}%"
