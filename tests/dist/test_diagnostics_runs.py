"""Real 2-process runs with a known bottleneck: the report must name it (asserted on report.json)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from diagnostics.telemetry import telemetry_path
from tests.conftest import REPO, read_manifest, run_cli

if TYPE_CHECKING:
    from tests.dist.conftest import FinishedRun

pytestmark = pytest.mark.dist

USER_MODEL = [
    "~model",
    "+model.vocab_size=10",
    "+model.seq_len=16",
    "~data",
    "+data._target_=tests.plugins.CountingData",
]
# How long rank 1's forward sleeps in the shared straggler run (tests/dist/conftest.py, SleepyRankModel's default).
SLEEP_S = 0.2
SHORT = [
    "trainer.max_steps=40",
    "trainer.log_every_n_steps=5",
    "trainer.val_every_n_steps=40",
    "trainer.val_batches=1",
    "trainer.micro_batch_size=4",
    "optimizer.lr=0.05",
    "optimizer.warmup_steps=2",
    "diagnostics.gather_every=5",
    "diagnostics.profile_wait_steps=20",
    "diagnostics.sample_interval_s=0.5",
]


def report_of(args: list[str], tmp_path: Path) -> dict:
    run_dir = tmp_path / "run"
    result = run_cli([*args, f"hydra.run.dir={run_dir}"], cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((run_dir / "report" / "report.json").read_text())


def findings(report: dict, kind: str) -> list[dict]:
    return [f for f in report["findings"] if f["kind"] == kind]


@pytest.mark.exclusive  # a diagnosis of where the time goes: run alone
def test_slow_datamodule_is_input_bound_with_a_workers_override(tmp_path: Path) -> None:
    report = report_of([*SHORT, *USER_MODEL[:-1], "+data._target_=tests.plugins.SlowCountingData",
                        "+model._target_=tests.plugins.BigramModel"], tmp_path)  # fmt: skip
    (finding,) = findings(report, "input_bound")
    assert finding["ranks"] == [0, 1]
    assert any(r["override"].lstrip("+").startswith("data.num_workers=") for r in finding["recommendations"])
    assert not findings(report, "straggler")


def test_sleeping_rank_is_named_as_straggler_although_ddp_equalizes_step_times(sleepy_rank_run: FinishedRun) -> None:
    """Rank 1 sleeps in forward (tests/dist/conftest.py's shared run, 30 steps)."""
    report = json.loads((sleepy_rank_run.run_dir / "report" / "report.json").read_text())
    (finding,) = findings(report, "straggler")
    assert finding["ranks"] == [1]
    per_rank = report["per_rank"]
    step_0, step_1 = (per_rank[r]["step_s"] for r in ("0", "1")) if isinstance(per_rank, dict) else (
        per_rank[0]["step_s"], per_rank[1]["step_s"])  # fmt: skip
    assert abs(step_0 - step_1) / step_1 < 0.1  # DDP made the step times equal: the gather is what tells
    assert not findings(report, "input_bound")


def test_user_model_and_datamodule_by_target(sleepy_rank_run: FinishedRun) -> None:
    """``+model._target_`` / ``+data._target_``: a BigramModel (SleepyRankModel: rank 1 also sleeps in forward) over
    CountingData, the launch shared with the straggler tests (tests/dist/conftest.py)."""
    manifest = read_manifest(sleepy_rank_run.run_dir)
    assert manifest["config"]["model"]["_target_"] == "tests.plugins.SleepyRankModel"
    assert manifest["config"]["data"]["_target_"] == "tests.plugins.CountingData"
    assert manifest["num_parameters"] == 10 * 32 + 32 * 10 + 10
    assert manifest["flops_per_token"] == 6.0 * 320
    assert manifest["result"]["val_loss"] < 1.0  # ln 10 = 2.3 at chance


def metric_series(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(row[key]) for row in rows if row.get(key) not in (None, "")]


def test_every_group_is_in_the_csv_with_the_reports_numbers(sleepy_rank_run: FinishedRun) -> None:
    run_dir, out, rows = sleepy_rank_run.run_dir, sleepy_rank_run.console, sleepy_rank_run.metrics
    report = json.loads((run_dir / "report" / "report.json").read_text())
    summary = report["summary"]
    # The run's rate and MFU, logged once at the end, are the report's; the console's summary line says the same.
    (run_rate,) = metric_series(rows, "throughput/tokens_per_s_run")
    headline = re.search(r"^\s+([\d,]+) tokens/s \| MFU", out, re.M)
    assert headline is not None, out[-2000:]
    assert run_rate == pytest.approx(float(headline.group(1).replace(",", "")), rel=0.05)
    assert run_rate == pytest.approx(summary["tokens_per_s"], abs=0.01)  # report.json keeps 2 decimals
    (mfu_run,) = metric_series(rows, "throughput/mfu_calibrated_run")
    assert mfu_run == pytest.approx(summary["calibrated_mfu"], rel=1e-3, abs=1e-6)  # as report.json rounds
    # Each logging window's rate: of the same order as the run's (windows differ by the box's noise).
    windows = metric_series(rows, "throughput/tokens_per_s")
    assert len(windows) >= 4 and all(run_rate / 3 < w < run_rate * 3 for w in windows), (windows, run_rate)
    per_device = metric_series(rows, "throughput/tokens_per_s_per_device")
    assert per_device == pytest.approx([w / 2 for w in windows])
    mfus = metric_series(rows, "throughput/mfu_calibrated")
    assert all(0 < m < 1 for m in mfus)
    assert not metric_series(rows, "throughput/mfu")  # hw=cpu has no datasheet peak: nothing made up

    p50, worst = metric_series(rows, "time/step_p50_s"), metric_series(rows, "time/step_max_s")
    assert all(SLEEP_S <= a <= b for a, b in zip(p50, worst, strict=True))  # every step waits for the sleeping rank
    assert summary["step_time"]["p50"] == pytest.approx(sorted(p50)[len(p50) // 2], rel=0.5)
    shares = [metric_series(rows, f"time/{k}") for k in ("data_wait_share", "compute_share")]
    assert all(0 <= v <= 1 for series in shares for v in series)

    rss = metric_series(rows, "memory/host_rss_gib")
    assert (
        rss and all(0.05 < v < 64 for v in rss) and all(0 < v < 100 for v in metric_series(rows, "memory/host_rss_pct"))
    )
    assert not any(key.startswith(("gpu/", "memory/allocated")) for key in rows[0])  # a CPU run: RSS, no NVML

    norms = metric_series(rows, "optim/grad_norm")
    assert norms and all(math.isfinite(v) and v > 0 for v in norms)
    assert set(metric_series(rows, "optim/skipped_steps")) == {0.0}


def test_the_ranks_gap_names_the_sleeping_rank_and_the_finding_appears_once(sleepy_rank_run: FinishedRun) -> None:
    run_dir, out, rows = sleepy_rank_run.run_dir, sleepy_rank_run.console, sleepy_rank_run.metrics
    slowest = metric_series(rows, "ranks/slowest_rank")
    gaps = metric_series(rows, "ranks/busy_gap_s")
    assert len(slowest) >= 4 and set(slowest) == {1.0}
    assert all(0.6 * SLEEP_S < g < 4 * SLEEP_S for g in gaps), gaps  # the sleep, seen through DDP's equal steps
    assert all(
        0 <= v <= 1 for v in metric_series(rows, "comm/exposed_share") + metric_series(rows, "comm/waiting_share")
    )
    # Rank 0 waits for rank 1 at the all-reduce: its comm wait beyond the transfer is waiting.
    assert max(metric_series(rows, "comm/waiting_share")) > 0.1

    (cost,) = metric_series(rows, "findings/straggler")
    assert cost >= 0.05
    lines = [line for line in out.splitlines() if "diagnostics (mid-run)" in line]
    assert len(lines) == 1 and re.search(r"step \d+: (warning|critical) straggler \[\d+% of step\]: rank 1 ", lines[0])
    # The end-of-run report agrees.
    report = json.loads((run_dir / "report" / "report.json").read_text())
    assert [f["ranks"] for f in report["findings"] if f["kind"] == "straggler"] == [[1]]


def test_validating_and_saving_every_few_steps_is_reported_as_pauses_with_rarer_intervals(tmp_path: Path) -> None:
    """Healthy steps, but 64 validation batches and a checkpoint every 5 of 40 steps: the step-based detectors see
    nothing (the collectors keep both out of the steps), the loop's time says where the run goes. Not exclusive:
    the pauses take most of the loop, far from the 5% line, whatever runs beside it."""
    args = [*SHORT, *USER_MODEL[:-1], "+data._target_=tests.plugins.CountingData",
            "+model._target_=tests.plugins.BigramModel", "trainer.val_every_n_steps=5", "trainer.val_batches=64",
            "trainer.ckpt_every_n_steps=5"]  # fmt: skip
    report = report_of(args, tmp_path)
    (finding,) = findings(report, "pauses")
    assert finding["ranks"] == [0, 1] and finding["severity"] == "critical"
    # Steps 5, 10, ..., 35 pause inside the measured loop; the validation and checkpoint at step 40 come after it.
    by_what = finding["evidence"]["by_what"]
    assert {what: by_what[what]["count"] for what in by_what} == {"validation": 7, "checkpoint": 7}
    assert finding["cost"]["fraction"] == pytest.approx(finding["evidence"]["share"], abs=1e-3)
    first = finding["recommendations"][0]["override"]
    key, value = first.split("=")
    assert key in ("trainer.val_every_n_steps", "trainer.ckpt_every_n_steps") and int(value) % 5 == 0 < int(value) - 5
    loop = report["summary"]["loop"]
    assert loop["loop_tokens_per_s"] < report["summary"]["tokens_per_s"] * (1 - loop["share"]) * 1.1
    for rank in (0, 1):
        records = [json.loads(line) for line in telemetry_path(tmp_path / "run", rank).read_text().splitlines()]
        pauses = [(r["what"], r["step"]) for r in records if r["kind"] == "pause"]
        steps = range(5, 41, 5)
        assert sorted(pauses) == sorted([("checkpoint", s) for s in steps] + [("validation", s) for s in steps])


@pytest.mark.exclusive
def test_big_gradients_over_tiny_batches_are_comm_bound(tmp_path: Path) -> None:
    args = [*SHORT, "trainer.max_steps=25", "trainer.micro_batch_size=1", *USER_MODEL,
            "+model._target_=tests.plugins.WideModel", "optimizer.lr=1e-3"]  # fmt: skip
    report = report_of(args, tmp_path)
    (finding,) = findings(report, "comm_bound")
    overrides = [r["override"] for r in finding["recommendations"]]
    assert any(
        o and o.startswith(("strategy.bucket_cap_mb=", "trainer.global_batch_size=", "strategy=")) for o in overrides
    )


# Rank 1 blocks in its model's forward, or one of its DataLoader workers blocks in the dataset's __getitem__.
HANGS = {
    "model": ["+data._target_=tests.plugins.CountingData", "+model._target_=tests.plugins.HangingRankModel"],
    "loader": ["+data._target_=tests.plugins.StuckLoaderData", "+model._target_=tests.plugins.BigramModel"],
}


@pytest.mark.parametrize("where", sorted(HANGS))
def test_hung_rank_fires_the_watchdog_names_it_and_leaves_no_process(where: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*SHORT, "trainer.max_steps=200", *USER_MODEL[:-1], *HANGS[where],
            "diagnostics.hang_timeout_s=10", "diagnostics.profile=false", f"hydra.run.dir={run_dir}"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "train", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the watchdog did not end the hung job")
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "no step completed in 10 s" in stderr
    assert elapsed < 10 + 30 + 30  # timeout + 30 s, plus start-up of the two processes
    stacks = sorted(p.name for p in (run_dir / "hang").glob("rank*.txt"))
    assert stacks == ["rank0000.txt", "rank0001.txt"]
    stack = (run_dir / "hang" / "rank0001.txt").read_text()
    report = json.loads((run_dir / "report" / "report.json").read_text())
    (finding,) = findings(report, "hang")
    assert finding["ranks"] == [1]
    if where == "model":
        assert "HangingRankModel" in stack or "forward" in stack
        assert "DataLoader" not in finding["message"]
    else:  # the rank's stack, then its worker's, stuck where the dataset blocks; the report says so
        assert "=== DataLoader worker process" in stack and "_StuckItems.__getitem__" in stack
        assert "rank 1 waits for its DataLoader workers (worker " in finding["message"]
        assert "_StuckItems.__getitem__ (tests/plugins.py:" in finding["message"]
        assert "waits for its DataLoader workers" in stderr
    time.sleep(1)
    leftover = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert leftover == [], f"processes left behind: {leftover}"


@pytest.mark.parametrize("raise_rank", [1, 0])
def test_a_rank_that_raises_is_named_and_its_error_ends_the_console(raise_rank: int, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*SHORT, "trainer.max_steps=20", *USER_MODEL, "+model._target_=tests.plugins.RaisingRankModel",
            f"+model.raise_rank={raise_rank}", "+model.at_call=6", f"hydra.run.dir={run_dir}"]  # fmt: skip
    result = run_cli(args, cwd=REPO, timeout=180)
    assert result.returncode == 1, result.stderr[-3000:]
    error = "ValueError: bad batch in training forward 6 (deliberate)"

    # The console ends with the raising rank's traceback, once, and the job's one-line summary.
    lines = result.stderr.rstrip().splitlines()
    assert lines[-1] == (
        f"disttrain: rank {raise_rank} raised in forward of step 6: {error}; stopping the job; "
        f"report: {run_dir / 'report' / 'report.md'}"
    )
    assert lines[-3:-1] == [error, "second line of the message"]
    assert result.stderr.count("Traceback (most recent call last)") == 1
    console = result.stdout + result.stderr
    assert "Connection closed by peer" not in console and "Error executing job" not in console

    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["status"] == "failed" and manifest["failed_rank"] == raise_rank
    assert (manifest["exception"], manifest["step"], manifest["phase"]) == ("ValueError", 6, "forward")
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["rank"] == raise_rank and failure["error"] == error and "plugins.py" in failure["traceback"]
    if raise_rank == 1:  # the child's own copy of its error is in its log, not on the console twice
        assert error in (run_dir / "train_rank1.log").read_text()

    report = json.loads((run_dir / "report" / "report.json").read_text())
    top = report["findings"][0]
    assert (top["kind"], top["severity"], top["ranks"]) == ("crash", "critical", [raise_rank])
    ev = top["evidence"]
    assert (ev["exception"], ev["message"], ev["step"], ev["phase"]) == (
        "ValueError", "bad batch in training forward 6 (deliberate)", 6, "forward")  # fmt: skip
    assert all(f["severity"] != "critical" for f in report["findings"][1:])

    # python -m diagnose on the run dir gives the same top finding (the same function wrote both).
    rebuilt = subprocess.run([sys.executable, "-m", "diagnose", str(run_dir)], cwd=REPO, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert rebuilt.returncode == 0
    assert f"critical crash [run stopped]: rank {raise_rank} raised in forward of step 6" in rebuilt.stdout


def test_a_datamodule_whose_batches_the_model_cannot_read_is_one_config_error_from_both_ranks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*SHORT, *USER_MODEL, "+data._target_=tests.plugins.DictBatchData", f"hydra.run.dir={run_dir}"]
    args.remove("+data._target_=tests.plugins.CountingData")
    result = run_cli(args, cwd=REPO, timeout=180)
    assert result.returncode == 2, result.stderr[-3000:]
    said = "disttrain: config error: data._target_: the first training batch is a dict (keys input_ids, labels)"
    lines = result.stderr.rstrip().splitlines()
    assert lines[-1].startswith(said) and "Fix: yield (inputs, targets) pairs" in lines[-1]
    console = result.stdout + result.stderr
    assert console.count("config error") == 1 and "Traceback" not in console and "died" not in console
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["status"] == "failed" and said.removeprefix("disttrain: ") in manifest["failure"]
    assert json.loads((run_dir / "failure.json").read_text())["traceback"] == ""
