"""``python -m tune`` for real: training runs (an input-bound loader), the interleaved A/B of the loader lever, the
keep rule's loss comparison over the same steps, the next round diagnosed from the kept arm's runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diagnostics.ab import VERDICTS, ledger
from tests.conftest import REPO
from tests.dist.test_ab_runs import TINY_INPUT_BOUND

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STOPS = ("no finding costs", "no config lever left", "tune.max_rounds=2", "the budget left")


def test_tune_two_rounds_of_a_real_input_bound_run(tmp_path: Path) -> None:
    out = tmp_path / "tune"
    # tune sets the steps itself (tune.steps); everything else is the tiny input-bound run of the A/B test.
    train = [o for o in TINY_INPUT_BOUND if not o.startswith("trainer.max_steps=")]
    settings = ["tune.steps=20", "tune.max_rounds=2", "tune.repeats=3", "tune.max_repeats=3", "tune.budget_min=12"]
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    command = [sys.executable, "-m", "tune", *train, *settings, f"tune.output_dir={out}"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    summary = json.loads((out / "tune" / "summary.json").read_text())
    assert summary["start_tokens_per_s"] > 0 and (out / "round0" / "telemetry").is_dir()
    rounds = summary["rounds"]
    assert 1 <= len(rounds) <= 2 and summary["stop_reason"].startswith(STOPS)
    first = rounds[0]
    assert first["finding"] == "input_bound" and first["override"].startswith("+data.num_workers=")
    assert first["lever"] == "loader" and first["verdict"] in VERDICTS
    # Loader workers feed the same batches in the same order: the losses over the same steps are identical.
    assert first["loss_gap"] == 0.0
    verdict = json.loads((out / "round1" / "verdict.json").read_text())["recommendations"][0]
    assert verdict["change"] == first["change"] and verdict["pairs"] == first["pairs"] == 3
    speedup = 1.0
    for row in rounds:
        speedup *= 1 + row["change"] if row["kept"] else 1
        assert row["cumulative"] == pytest.approx(speedup)
        assert row["kept"] == (row["verdict"] == "confirmed")  # within tolerance whenever confirmed: gap 0
    kept = [r["override"] for r in rounds if r["kept"]]
    assert summary["kept"] == kept and all(k in summary["final_overrides"] for k in kept)
    assert not any(
        o.startswith(("trainer.max_steps=", "trainer.ckpt_every_n_steps=")) for o in summary["final_overrides"]
    )
    entries = ledger.read(tmp_path / ledger.LEDGER)
    assert [e["override"] for e in entries] == [r["override"] for r in rounds]
    assert all(e["source"] == "tune" and e["context"]["world_size"] == 1 for e in entries)
    assert f"tune: summary {out / 'tune' / 'summary.md'}" in result.stdout
