"""The path of a run from ``python -m train`` to ``trainer.fit``: at most five calls of the project's own code, so a
reader follows one line from the command to the training loop (issue 66). Read from a real one-process run whose
``Trainer.fit`` reports the stack that reached it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

PROBE = """
import json, os, sys, traceback
import lightning.pytorch as pl

def fit(self, *args, **kwargs):
    frames = [(frame.filename, frame.name) for frame in traceback.extract_stack()[:-1]]
    print("STACK " + json.dumps(frames), flush=True)
    os._exit(0)

pl.Trainer.fit = fit
sys.argv = ["train", *sys.argv[1:]]
import train
train.cli()
"""
OWN = (str(REPO / "pipelines"), str(REPO / "src" / "disttrain"))


def test_the_command_reaches_trainer_fit_in_at_most_five_calls(tmp_path: Path, tiny_run_args: list[str]) -> None:
    args = [*tiny_run_args, "hw.devices_per_node=1", "trainer.max_steps=4", f"hydra.run.dir={tmp_path / 'run'}"]
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    stacks = [line for line in done.stdout.splitlines() if line.startswith("STACK ")]
    assert stacks, done.stdout + done.stderr
    frames = json.loads(stacks[0].removeprefix("STACK "))
    own = [name for filename, name in frames if filename.startswith(OWN)]
    assert own[0] == "cli", own
    assert own == ["cli", "hydra_app", "train", "run_from_hydra", "run"], own
    assert len(own) <= 5
