"""No recommendation the run's own evidence contradicts (diagnostics/recommend.py LEVER_NEEDS), and a report.json
recommendation always has an override: an explanation without one is evidence."""

from __future__ import annotations

import json

from diagnostics.analysis import analyse
from diagnostics.recommend import recommend_all
from diagnostics.report import diagnose_run
from tests.diag_fixtures import write_run


def recs_for(run_dir, kind):
    analysis = analyse(run_dir)
    by_kind = dict(zip([f.kind for f in analysis.findings], recommend_all(analysis), strict=True))
    return by_kind[kind]


def test_no_loader_workers_on_a_host_whose_cores_are_all_busy(tmp_path):
    # 2 ranks x 1 thread on 2 cores: workers would take cores from the compute they feed.
    recs = recs_for(write_run(tmp_path / "busy", "input_bound", cpu_count=2), "input_bound")
    assert not any("num_workers" in r.override for r in recs)
    assert any("every core is busy" in r.why for r in recs if not r.override)
    # The same run on a host with idle cores gets them.
    recs = recs_for(write_run(tmp_path / "idle", "input_bound", cpu_count=16), "input_bound")
    assert any("num_workers" in r.override for r in recs)


def test_report_json_holds_only_overrides_as_recommendations(tmp_path):
    run_dir = write_run(tmp_path / "s", "straggler")  # a straggler has no config lever: only an explanation
    diagnose_run(run_dir)
    report = json.loads((run_dir / "report" / "report.json").read_text())
    straggler = next(f for f in report["findings"] if f["kind"] == "straggler")
    assert straggler["recommendations"] == []
    assert "is slow in" in straggler["explanation"][0]["why"]
    for finding in report["findings"]:
        assert all(rec["override"] for rec in finding["recommendations"])
