"""report.json schema, HTML safety and self-containment, Markdown and text contents, and no torch import."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from diagnostics.report import build_report, diagnose_run, write_report
from tests.conftest import REPO
from tests.diag_fixtures import write_run

HOSTILE = "<script>alert('x')</script>"


def test_report_json_schema(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "cb", "comm_bound")
    diagnose_run(run_dir)
    data = json.loads((run_dir / "report" / "report.json").read_text())
    summary = data["summary"]
    for key in ("tokens_per_s", "mfu", "hfu", "calibrated_mfu", "step_time", "peak_memory", "accounting_errors"):
        assert key in summary
    assert set(summary["step_time"]) >= {"p50", "p90", "p99"}
    assert summary["tokens_per_s"] > 0 and summary["peak_memory"]["peak_rss_bytes"] > 0
    assert [r["rank"] for r in data["per_rank"]] == [0, 1]
    for row in data["per_rank"]:
        for phase in ("data_wait_s", "forward_s", "backward_s", "optimizer_s", "comm_wait_s", "step_s"):
            assert isinstance(row[phase], float)
    assert [f["kind"] for f in data["findings"]] == ["comm_bound", "low_overlap"]
    for finding in data["findings"]:
        assert {"kind", "severity", "ranks", "evidence", "message", "cost", "recommendations"} <= set(finding)
        assert set(finding) <= {
            "kind",
            "severity",
            "ranks",
            "evidence",
            "message",
            "cost",
            "recommendations",
            "explanation",
        }
        assert all(rec["override"] for rec in finding["recommendations"])  # an explanation is not a recommendation
        assert 0.0 <= finding["cost"]["fraction"] <= 1.0 and finding["cost"]["basis"]
        for rec in finding["recommendations"]:
            assert {"override", "why", "expected_gain"} <= set(rec)
            gain = rec["expected_gain"]
            assert 0.0 <= gain["fraction"] <= finding["cost"]["fraction"] and gain["basis"]
    costs = [f["cost"]["fraction"] for f in data["findings"]]
    assert costs == sorted(costs, reverse=True)  # the biggest lever first
    assert data["findings"][0]["recommendations"][0]["override"] == "trainer.global_batch_size=64"
    assert data["thresholds"]["COMM_BOUND_FRACTION"] == 0.25
    assert data["context"]["strategy"] == "ddp"


def test_rebuilding_gives_the_same_report(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "ib", "input_bound")
    first = build_report(run_dir).to_json()
    second = build_report(run_dir).to_json()
    first.pop("generated_at"), second.pop("generated_at")
    assert first == second


def test_html_escapes_user_strings_and_is_self_contained(tmp_path: Path) -> None:
    patch = {"model": {"name": HOSTILE}, "data": {"name": "a&b", "num_workers": 0}}
    run_dir = write_run(tmp_path / "x", "input_bound", config_patch=patch)
    out = write_report(build_report(run_dir))
    html = (out / "report.html").read_text()
    assert "<script" not in html.lower()
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    assert "a&amp;b" in html
    # Self-contained: nothing to fetch (inline SVG in HTML needs no namespace URL either).
    assert "http://" not in html and "https://" not in html
    assert not re.search(r"""(src|href)\s*=""", html)
    assert "@import" not in html and "url(" not in html
    assert html.count('<svg class="plot"') == 5


def test_markdown_and_text_summary(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "ib", "input_bound")
    report = diagnose_run(run_dir)
    md = (run_dir / "report" / "report.md").read_text()
    assert "## Findings" in md and "### critical: input_bound (ranks 0, 1)" in md
    assert "`data.num_workers=2`" in md and "python -m train -m data.num_workers=0,2" in md
    assert "| rank | steps | step |" in md
    text = report.text_summary()
    lines = text.splitlines()
    assert len(lines) <= 12
    # The verdict leads: where the step goes, then what the top fix buys; the headline numbers follow.
    assert lines[0].startswith("diagnostics: step = compute ")
    for share in ("data 46%", "communication ", "bubble 0%", "host "):
        assert share in lines[0]
    assert lines[0].endswith("top: input_bound costs 46%, data.num_workers=2 expected to save ~46% of the step")
    assert "tokens/s" in lines[1]
    assert "critical input_bound [46% of step]" in lines[2] and "-> try data.num_workers=2" in lines[2]
    assert "costs 46% of the step" in md and "saves ~46% of the step" in md
    assert lines[-1].startswith(f"report: {run_dir / 'report' / 'report.html'}")


def test_a_costly_finding_from_one_source_is_not_called_nothing(tmp_path: Path) -> None:
    """A one-GPU run has one profiler window: its host_overhead is info (one source), and the verdict says what it
    may cost and how to measure it, not "nothing costs 5%" (an H200's gpt2-124m run said both at once)."""
    from diagnostics.telemetry import telemetry_path

    run_dir = write_run(tmp_path / "one", "host_overhead")
    lines = telemetry_path(run_dir, 1).read_text().splitlines()
    telemetry_path(run_dir, 1).write_text("".join(line + "\n" for line in lines if '"profile"' not in line))
    verdict = build_report(run_dir).text_summary().splitlines()[0]
    assert "no fix worth making" not in verdict
    assert re.search(r"host_overhead may cost \d+% but rests on one source only \(info\)", verdict), verdict
    assert "`diagnose --ab` with trainer.micro_batch_size=" in verdict


def test_healthy_text_summary_says_nothing_is_wrong(tmp_path: Path) -> None:
    report = build_report(write_run(tmp_path / "ok", "healthy"))
    assert "nothing costs 5% of the step or more: no fix worth making" in report.text_summary().splitlines()[0]
    assert report.written_to is None and "report:" not in report.text_summary()


def test_analysis_recommend_report_and_cli_run_without_torch(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "s", "straggler")
    code = f"""
import sys
for blocked in ("torch", "torch.distributed", "lightning", "lightning.pytorch", "pytorch_lightning", "disttrain"):
    sys.modules[blocked] = None  # any import of these now raises ImportError
import diagnostics.analysis, diagnostics.recommend, diagnostics.report, diagnostics.mfu, diagnostics.ab
del sys.modules["disttrain"]  # the CLI (pipelines/) may use the core's torch-free parts, e.g. its exit codes
import diagnose
report = diagnostics.report.diagnose_run({str(run_dir)!r})
assert report.kinds() == ["straggler"], report.kinds()
assert diagnose.main([{str(run_dir)!r}]) == 0
assert diagnose.main([{str(run_dir)!r}, "--ab"]) == 0
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_report_lists_each_attempts_world_after_an_elastic_restart(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "el", "healthy")
    manifest = json.loads((run_dir / "run.json").read_text())
    manifest["attempts"] = [
        {"attempt": 0, "world_size": 2, "global_batch": 8, "accumulation": 1},
        {"attempt": 1, "world_size": 1, "global_batch": 8, "accumulation": 2},
    ]
    (run_dir / "run.json").write_text(json.dumps(manifest))
    report = diagnose_run(run_dir)
    md = (run_dir / "report" / "report.md").read_text()
    line = "attempts: 0: world 2 (global batch 8, accumulation 1); 1: world 1 (global batch 8, accumulation 2)"
    assert md.count(line) == 1
    assert json.loads((run_dir / "report" / "report.json").read_text())["context"]["attempts"][1]["world_size"] == 1
    single = write_run(tmp_path / "one", "healthy")
    assert "attempts:" not in (diagnose_run(single).written_to / "report.md").read_text()
    assert report.context()["attempts"] == manifest["attempts"]
