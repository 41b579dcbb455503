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
        assert set(finding) == {"kind", "severity", "ranks", "evidence", "message", "recommendations"}
        assert finding["recommendations"] and all({"override", "why"} <= set(r) for r in finding["recommendations"])
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
    assert lines[0].startswith("diagnostics: ") and "tokens/s" in lines[0]
    assert "input_bound" in lines[1] and "-> try data.num_workers=2" in lines[1]
    assert lines[-1].startswith(f"report: {run_dir / 'report' / 'report.html'}")


def test_healthy_text_summary_says_nothing_is_wrong(tmp_path: Path) -> None:
    report = build_report(write_run(tmp_path / "ok", "healthy"))
    assert "no bottleneck found" in report.text_summary()
    assert report.written_to is None and "report:" not in report.text_summary()


def test_analysis_recommend_report_and_cli_run_without_torch(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "s", "straggler")
    code = f"""
import sys
for blocked in ("torch", "torch.distributed", "lightning", "lightning.pytorch", "pytorch_lightning"):
    sys.modules[blocked] = None  # any import of these now raises ImportError
import diagnostics.analysis, diagnostics.recommend, diagnostics.report, diagnostics.mfu, diagnostics.ab
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
