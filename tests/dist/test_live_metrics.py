"""The user's logger gets what the console and the report know, while the run goes: one 2-rank CSV run with a
straggler (rank 1 sleeps in its forward: tests/dist/conftest.py's sleepy_rank_run, shared with the straggler's
diagnosis and the plug-in model test) read back from metrics.csv. The TensorBoard and wandb loggers' runs are in
test_runs.py (their launches are shared with the data-kind tests)."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.dist.conftest import SLEEP_S, FinishedRun

pytestmark = pytest.mark.dist


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
