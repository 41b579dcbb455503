"""``python -m diagnose`` as a user runs it: report, A/B commands (and launching them), compare, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_ab_prints_the_arms_it_would_run(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "memory_pressure")
    result = diagnose([str(run_dir), "--ab", "--top-k", "2"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    set_dir = run_dir.resolve() / "ab" / "set1"
    assert result.stdout.startswith("# A/B: arms interleaved per round (A B1 B2), 3 rounds, up to 10 ")
    commands = [line for line in result.stdout.splitlines() if line.startswith("python -m train ")]
    original = "hw=8xh100 hw.devices_per_node=2 precision=bf16-mixed"
    assert commands == [
        f"python -m train {original} hydra.run.dir={set_dir}/01-A",
        f"python -m train {original} trainer.global_batch_size=32 trainer.micro_batch_size=8 "
        f"hydra.run.dir={set_dir}/01-B1",
        f"python -m train {original} strategy=fsdp hydra.run.dir={set_dir}/01-B2",
    ]
    assert not (run_dir / "report").exists() and not (run_dir / "ab").exists()  # --ab only prints


# A stand-in for ``python -m train``: records its arguments, then writes a run dir whose throughput record is
# 1000 tokens/s times the factor FAKE_RULES gives the first of its overrides it lists, for that round.
FAKE_TRAIN = """
import json, os, sys
from pathlib import Path
from diagnostics.telemetry import TelemetryWriter

args = sys.argv[1:]
with open(sys.argv[0] + ".calls", "a") as f:
    f.write(json.dumps(args) + "\\n")
run_dir = Path(next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")))
round_no = int(run_dir.name.split("-")[0])
factor = 1.0
for override, rule in json.loads(os.environ["FAKE_RULES"]).items():
    if override in args:
        if rule == "fail":
            sys.exit("RuntimeError: the recommended arm crashed")
        factor = rule[min(round_no, len(rule)) - 1]
        break
writer = TelemetryWriter(run_dir, 0)
writer.write("meta", world_size=1)
writer.write("throughput", tokens_per_s=1000.0 * factor)
writer.close()
"""


def fake_train(tmp_path: Path, rules: dict) -> tuple[Path, dict]:
    fake = tmp_path / "fake"
    fake.mkdir(exist_ok=True)
    (fake / "train.py").write_text(FAKE_TRAIN)
    return fake / "train.py.calls", {**os.environ, "PYTHONPATH": str(fake), "FAKE_RULES": json.dumps(rules)}


def test_ab_run_interleaves_the_arms_and_writes_a_verdict_each(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "memory_pressure")
    micro = "trainer.micro_batch_size=8"
    calls, env = fake_train(tmp_path, {micro: [1.2, 1.22, 1.19], "strategy=fsdp": "fail"})
    result = diagnose([str(run_dir), "--ab", "--run", "--top-k", "2", "--max-repeats", "5"], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    runs = [json.loads(line) for line in calls.read_text().splitlines()]
    names = [Path(a[-1].split("=", 1)[1]).name for a in runs]
    # Settled after the minimum 3 rounds: B1 resolved (confirmed), B2 failed.
    assert names == [f"{r:02d}-{arm}" for r in (1, 2, 3) for arm in ("A", "B1", "B2")]
    assert runs[0][:-1] == ["hw=8xh100", "hw.devices_per_node=2", "precision=bf16-mixed"]
    assert micro in runs[1] and "strategy=fsdp" in runs[2]
    verdict = json.loads((run_dir / "ab" / "verdict.json").read_text())
    assert verdict == json.loads((run_dir / "ab" / "set1" / "verdict.json").read_text())
    b1, b2 = verdict["recommendations"]
    assert (b1["override"], b1["verdict"], b1["rounds"]) == (
        f"trainer.global_batch_size=32 {micro}",
        "confirmed",
        [1, 2, 3],
    )
    assert b1["original"]["tokens_per_s"] == [1000.0] * 3 and b1["recommended"]["tokens_per_s"] == [1200, 1220, 1190]
    assert b1["recommended"]["median_tokens_per_s"] == 1200.0
    assert b1["change"] == pytest.approx((1.2 * 1.22 * 1.19) ** (1 / 3) - 1)
    assert b1["ci"][0] > 0 and b1["recommended"]["run_dirs"] == ["ab/set1/01-B1", "ab/set1/02-B1", "ab/set1/03-B1"]
    assert b2["verdict"] == "failed" and b2["recommended"]["failed"] == 3
    assert "the recommended arm crashed" in b2["recommended"]["errors"][0]
    md = (run_dir / "ab" / "verdict.md").read_text()
    assert f"| `trainer.global_batch_size=32 {micro}` | confirmed | +20.3% |" in md
    assert "3 of 3 runs of the recommended arm failed" in md
    out = result.stdout.splitlines()
    crashed = "ab: round 1 B2 (strategy=fsdp): failed, exit code 1: RuntimeError: the recommended arm crashed (log: "
    assert out[9].startswith(crashed) and f"{run_dir.resolve()}/ab/set1/01-B2.log) [" in out[9]
    assert (
        out[-1] == f"verdict: {run_dir.resolve()}/ab/verdict.md (also verdict.json); report: {run_dir}/report/report.md"
    )
    # The original run's report now shows what the A/B found, and stops recommending the failed change blindly.
    report = json.loads((run_dir / "report" / "report.json").read_text())
    assert report["ab_verdict"] == "ab/verdict.md"
    recs = {r["override"]: r for r in report["findings"][0]["recommendations"]}
    assert recs[f"trainer.global_batch_size=32 {micro}"]["verdict"]["verdict"] == "confirmed"
    assert recs["strategy=fsdp"]["verdict"]["verdict"] == "failed"
    summary = diagnose([str(run_dir)], cwd=tmp_path).stdout
    assert f"-> trainer.global_batch_size=32 {micro}: A/B confirmed +20.3% (95% CI" in summary
    assert (
        "A/B-tested: failed (3 of 3 runs of the recommended arm failed)"
        in (run_dir / "report" / "report.md").read_text()
    )
    html = (run_dir / "report" / "report.html").read_text()
    assert "<h2>A/B verdicts</h2>" in html
    assert '<strong class="ab" data-verdict="confirmed">A/B-tested: confirmed +20.3%' in html
    # Both tests went to the advice ledger of the output root (the run dir's parent here), scored per finding kind.
    entries = [json.loads(line) for line in (tmp_path / "advice_ledger.jsonl").read_text().splitlines()]
    assert [(e["source"], e["finding"], e["override"], e["verdict"]) for e in entries] == [
        ("diagnose --ab", "memory_pressure", b1["override"], "confirmed"),
        ("diagnose --ab", "memory_pressure", "strategy=fsdp", "failed"),
    ]
    assert entries[0]["measured_change"] == b1["change"] and entries[0]["context"]["hw"] == "8xh100"
    advice = diagnose(["advice", str(tmp_path)], cwd=tmp_path).stdout
    assert "memory_pressure      2         1" in advice


def test_ab_run_adds_rounds_while_unresolved_and_a_new_set_each_time(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "input_bound")
    calls, env = fake_train(tmp_path, {"data.num_workers=2": [1.06, 0.95, 1.01, 1.001, 0.999]})
    args = [str(run_dir), "--ab", "--run", "--max-repeats", "5"]
    ab = diagnose(args, cwd=tmp_path, env=env)
    assert ab.returncode == 0
    lines = ab.stdout.splitlines()
    assert sum(line.startswith("ab: round ") for line in lines) == 10  # a line per run, each once
    assert lines[-1].startswith(f"verdict: {run_dir.resolve()}/ab/verdict.md")
    report = json.loads((run_dir / "report" / "report.json").read_text())
    assert report["ab_verdict"] == "ab/verdict.md"
    (tested,) = [r for r in report["findings"][0]["recommendations"] if r["override"] == "data.num_workers=2"]
    assert tested["verdict"]["verdict"] == "no measurable effect"
    names = [Path(json.loads(line)[-1].split("=", 1)[1]).name for line in calls.read_text().splitlines()]
    assert names == [f"{r:02d}-{arm}" for r in range(1, 6) for arm in ("A", "B1")]
    (first,) = json.loads((run_dir / "ab" / "verdict.json").read_text())["recommendations"]
    assert first["verdict"] == "no measurable effect" and not first["resolved"] and first["pairs"] == 5
    assert "too noisy to resolve a 3% change" in first["reason"]
    summary = diagnose([str(run_dir)], cwd=tmp_path).stdout
    assert "-> data.num_workers=2 was A/B-tested: no measurable effect" in summary
    # A second A/B keeps the first one's runs and verdict, in a set of its own; the newest verdict wins.
    _, env = fake_train(tmp_path, {"data.num_workers=2": [1.3, 1.31, 1.29]})
    assert diagnose([str(run_dir), "--ab", "--run", "--max-repeats", "3"], cwd=tmp_path, env=env).returncode == 0
    assert sorted(p.name for p in (run_dir / "ab").iterdir() if p.is_dir()) == ["set1", "set2"]
    assert len(list((run_dir / "ab" / "set1").glob("0?-*.log"))) == 10
    verdict = json.loads((run_dir / "ab" / "verdict.json").read_text())
    assert verdict["sets"] == ["set1", "set2"]
    (newest,) = verdict["recommendations"]
    assert (newest["set"], newest["verdict"], newest["rounds"]) == ("set2", "confirmed", [1, 2, 3])
    assert json.loads((run_dir / "ab" / "set1" / "verdict.json").read_text())["recommendations"] == [first]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ab", "--run", "--repeats", "2"], "--repeats 2 is too few"),
        (["--ab", "--repeats", "4", "--max-repeats", "3"], "--max-repeats 3 is below --repeats 4"),
        (["--repeats", "5"], "--repeats and --max-repeats set the A/B runs: add --ab --run"),
    ],
)
def test_bad_repeats_are_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    run_dir = write_run(tmp_path / "run", "input_bound")
    result = diagnose([str(run_dir), *args], cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"diagnose: error: {message}") and result.stderr.count("\n") == 1
    assert not (run_dir / "ab").exists()


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
    advice = diagnose(["advice", str(tmp_path / "empty")], cwd=tmp_path)
    assert advice.returncode == 2 and advice.stderr.count("\n") == 1 and "no advice ledger" in advice.stderr
