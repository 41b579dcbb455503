"""``python -m diagnose`` as a user runs it: report, A/B commands (and launching them), compare, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.diag_fixtures import write_run


def diagnose(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diagnose", *args], cwd=cwd, capture_output=True, text=True, timeout=60, env=env
    )


def test_report_is_rebuilt_from_telemetry(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "input_bound")
    result = diagnose([str(run_dir)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert {p.name for p in (run_dir / "report").iterdir()} == {"report.md", "report.html", "report.json"}
    assert "input_bound" in result.stdout and "-> try data.num_workers=2" in result.stdout
    assert f"report: {run_dir / 'report' / 'report.html'}" in result.stdout
    data = json.loads((run_dir / "report" / "report.json").read_text())
    assert data["findings"][0]["kind"] == "input_bound"


def test_ab_prints_one_multirun_per_recommendation(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "memory_pressure")
    result = diagnose([str(run_dir), "--ab", "--top-k", "2"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    commands = [line for line in result.stdout.splitlines() if line.startswith("python -m train -m ")]
    assert len(commands) == 2
    original = "hw=8xh100 hw.devices_per_node=2 precision=bf16-mixed"
    assert commands[0].startswith(f"python -m train -m {original} trainer.global_batch_size=32 ")
    assert " trainer.micro_batch_size=16,8 " in commands[0]
    assert " strategy=ddp,fsdp " in commands[1]
    assert not (run_dir / "report").exists()  # --ab only prints


def test_ab_run_launches_the_sweeps(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "input_bound")
    fake = tmp_path / "fake"
    fake.mkdir()
    # A stand-in for the training entry point that records how it was called.
    record = "with open(sys.argv[0] + '.calls', 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
    (fake / "train.py").write_text("import json, sys\n" + record)
    env = {**os.environ, "PYTHONPATH": str(fake)}
    result = diagnose([str(run_dir), "--ab", "--run"], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    calls = [json.loads(line) for line in (fake / "train.py.calls").read_text().splitlines()]
    assert calls == [["-m", "data.num_workers=0,2", f"hydra.sweep.dir={run_dir.resolve()}/ab/data.num_workers"]]


def test_compare_links_the_change_to_the_finding_it_fixed(tmp_path: Path) -> None:
    slow = write_run(tmp_path / "a", "input_bound")
    fixed = write_run(tmp_path / "b", "healthy", config_patch={"data": {"num_workers": 2}})
    result = diagnose(["compare", str(slow), str(fixed)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "data.num_workers: 0 -> 2" in out
    assert "tokens/s" in out and "(better)" in out
    assert "gone in B:  input_bound" in out
    assert (
        "data.num_workers: 0 -> 2 was recommended in A for input_bound (`data.num_workers=2`); input_bound is gone"
        in out
    )


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    missing = diagnose([str(tmp_path / "nope")], cwd=tmp_path)
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and missing.stderr.startswith("diagnose: error: run directory")
    assert str(tmp_path / "nope") in missing.stderr
    (tmp_path / "empty").mkdir()
    empty = diagnose([str(tmp_path / "empty")], cwd=tmp_path)
    assert empty.returncode == 2 and empty.stderr.count("\n") == 1
    assert "has no telemetry" in empty.stderr and "diagnostics on" in empty.stderr
    write_run(tmp_path / "sweep" / "0", "healthy")
    sweep = diagnose([str(tmp_path / "sweep")], cwd=tmp_path)
    assert sweep.returncode == 2 and "is a multirun with jobs ['0']" in sweep.stderr
    compare = diagnose(["compare", str(tmp_path / "empty"), str(tmp_path / "nope")], cwd=tmp_path)
    assert compare.returncode == 2 and compare.stderr.startswith("diagnose: error:")
