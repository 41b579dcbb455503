"""Run ``python -m train`` into a throw-away run dir and return its run.json (shared by the benchmarks)."""

from __future__ import annotations

import json
import os
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
