"""The sweep report over hand-made run dirs: ranking, Pareto front, scaling, failures; the diagnose CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from diagnostics.report.sweep import build_sweep_report
from diagnostics.report.sweep_render import write_sweep_report
from tests.conftest import REPO

GIB = 1024**3


def make_run(
    sweep: Path,
    name: str,
    overrides: list[str],
    *,
    loss: float | None = None,
    tokens_per_s: float | None = None,
    memory_gib: float | None = None,
    world: int = 2,
    failure: str | None = None,
    finding: str | None = "input_bound",
) -> Path:
    run = sweep / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if failure is not None:
        (run / "failure.json").write_text(json.dumps({"error": failure, "traceback": f"Traceback ...\n{failure}"}))
        return run
    if loss is None:
        return run  # started, never finished: still running or killed without a record
    manifest = {
        "status": "completed",
        "world": {"world_size": world},
        "result": {"steps": 10, "train_loss": loss + 0.1, "val_loss": loss, "tokens_per_s": tokens_per_s},
    }
    (run / "run.json").write_text(json.dumps(manifest))
    report = {
        "summary": {
            "tokens_per_s": tokens_per_s,
            "world_size": world,
            "mfu": None,
            "calibrated_mfu": 0.25,
            "peak_memory": {"peak_rss_bytes": memory_gib * GIB if memory_gib else None},
        },
        "findings": [{"kind": finding, "severity": "warning", "message": "ranks wait for data"}] if finding else [],
    }
    (run / "report").mkdir()
    (run / "report" / "report.json").write_text(json.dumps(report))
    return run


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    root = tmp_path / "multirun"
    base = ["model=gpt-nano"]
    make_run(
        root,
        "0",
        [*base, "optimizer.lr=1e-3", "hw.devices_per_node=1"],
        loss=2.0,
        tokens_per_s=100,
        memory_gib=1.0,
        world=1,
    )
    make_run(
        root,
        "1",
        [*base, "optimizer.lr=1e-3", "hw.devices_per_node=2"],
        loss=1.5,
        tokens_per_s=180,
        memory_gib=2.0,
        world=2,
    )
    make_run(
        root, "2", [*base, "optimizer.lr=3e-3", "hw.devices_per_node=2"], loss=1.8, tokens_per_s=150, memory_gib=3.0
    )
    make_run(
        root, "3", [*base, "optimizer.lr=1e-2", "hw.devices_per_node=2"], failure="RuntimeError: loss <b>exploded</b>"
    )
    make_run(root, "4", [*base, "optimizer.lr=3e-2", "hw.devices_per_node=2"])
    (root / ".submitit" / "17").mkdir(parents=True)  # submitit's folder is not a run
    return root  # fmt: skip


def test_runs_are_ranked_by_final_loss_with_failures_last(sweep: Path) -> None:
    report = build_sweep_report(sweep)
    assert [r.name for r in report.runs] == ["1", "2", "0", "4", "3"]
    assert [r.status for r in report.runs] == ["completed", "completed", "completed", "running", "failed"]
    assert report.varying == ["hw.devices_per_node", "optimizer.lr"]
    assert report.label(report.runs[0]) == "hw.devices_per_node=2 optimizer.lr=1e-3"
    best = report.runs[0]
    assert (best.final_loss, best.tokens_per_s, best.mfu, best.mfu_basis) == (1.5, 180, 0.25, "calibrated")
    assert best.peak_memory_bytes == 2 * GIB and best.top_finding == "warning input_bound: ranks wait for data"
    assert [r.name for r in report.failed] == ["3"] and report.failed[0].error == "RuntimeError: loss <b>exploded</b>"


def test_pareto_front_and_scaling_efficiency(sweep: Path) -> None:
    report = build_sweep_report(sweep)
    # 0: slow but small; 1: faster and larger; 2 is slower than 1 with more memory: dominated.
    assert report.pareto == ["0", "1"]
    (series,) = report.scaling  # 0 and 1 differ only in hw.devices_per_node
    assert series.fixed == {"model": "gpt-nano", "optimizer.lr": "1e-3"}
    assert [(p.run, p.world_size) for p in series.points] == [("0", 1), ("1", 2)]
    assert series.points[1].speedup == pytest.approx(1.8) and series.points[1].efficiency == pytest.approx(0.9)


def test_written_report_is_json_markdown_and_self_contained_html(sweep: Path) -> None:
    report = build_sweep_report(sweep)
    out = write_sweep_report(report)
    data = json.loads((out / "sweep.json").read_text())
    assert data["failed"] == ["3"] and data["pareto_front"] == ["0", "1"]
    assert [r["name"] for r in data["runs"]] == ["1", "2", "0", "4", "3"]
    markdown = (out / "sweep.md").read_text()
    assert "## Failed runs" in markdown and "RuntimeError: loss <b>exploded</b>" in markdown
    assert "| 1 | 1 | hw.devices_per_node=2 optimizer.lr=1e-3 | completed | 1.5000 (val) | 180 |" in markdown
    html = (out / "sweep.html").read_text()
    assert html.count("<svg") == 2 and "<script" not in html and "http" not in html.split("</style>")[1]
    assert "loss &lt;b&gt;exploded&lt;/b&gt;" in html and "<b>exploded" not in html
    assert (
        "sweep.html" in report.text_summary()
        and "failed: hw.devices_per_node=2 optimizer.lr=1e-2 (3): RuntimeError" in report.text_summary()
    )
    # Rebuilding over a dir that now holds report/ finds the same runs (the report is not a run).
    assert [r.name for r in build_sweep_report(sweep).runs] == [r.name for r in report.runs]


def diagnose(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "diagnose", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_diagnose_sweep_command(sweep: Path, tmp_path: Path) -> None:
    result = diagnose("sweep", str(sweep))
    assert result.returncode == 0, result.stderr
    assert "5 runs, 3 completed, 1 failed" in result.stdout and (sweep / "report" / "sweep.html").exists()
    missing = diagnose("sweep", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "is not a directory" in missing.stderr
    (tmp_path / "empty").mkdir()
    empty = diagnose("sweep", str(tmp_path / "empty"))
    assert empty.returncode == 2 and "no runs under" in empty.stderr
