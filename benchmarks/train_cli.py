"""Run ``python -m train`` into a throw-away run dir and return its run.json (shared by the benchmarks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def train_manifest(overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        subprocess.run(
            [sys.executable, "-m", "train", *overrides, f"hydra.run.dir={run_dir}"],
            check=True,
            cwd=tmp,
            stdout=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        return json.loads((run_dir / "run.json").read_text())
