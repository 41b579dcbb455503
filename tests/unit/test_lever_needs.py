"""No recommendation the run's own evidence contradicts (diagnostics/recommend.py LEVER_NEEDS), and a report.json
recommendation always has an override: an explanation without one is evidence."""

from __future__ import annotations

import json

from diagnostics.diagnosis import analyse
from diagnostics.recommend import recommend_all
from diagnostics.report import diagnose_run
from tests.diag_fixtures import write_run


def recs_for(run_dir, kind):
    analysis = analyse(run_dir)
    by_kind = dict(zip([f.kind for f in analysis.findings], recommend_all(analysis), strict=True))
    return by_kind[kind]


def workers(tmp_path, name, **changes):
    recs = recs_for(write_run(tmp_path / name, "input_bound", **changes), "input_bound")
    return any("num_workers" in r.override for r in recs), [r.why for r in recs if not r.override]


def test_no_loader_workers_for_loading_that_computes_on_a_host_whose_cores_are_all_busy(tmp_path):
    # 2 ranks x 1 thread on 2 cores, the training thread busy computing its batches: workers would take cores from
    # the compute they feed (measured: one worker per rank made such a run slower).
    offered, why = workers(tmp_path, "busy-cpu", cpu_count=2, data_cpu=0.95)
    assert not offered and any("every core is busy" in w for w in why)
    # Loading that waits (I/O, a sleep) needs no core of its own: workers overlap the wait even on a busy host.
    assert workers(tmp_path, "busy-io", cpu_count=2, data_cpu=0.02)[0]
    # Idle cores: workers whatever the loading does; older telemetry (no CPU share) on a busy host: refused.
    assert workers(tmp_path, "idle", cpu_count=16, data_cpu=0.95)[0]
    assert not workers(tmp_path, "unknown", cpu_count=2)[0]


def test_report_json_holds_only_overrides_as_recommendations(tmp_path):
    run_dir = write_run(tmp_path / "s", "straggler")  # a straggler has no config lever: only an explanation
    diagnose_run(run_dir)
    report = json.loads((run_dir / "report" / "report.json").read_text())
    straggler = next(f for f in report["findings"] if f["kind"] == "straggler")
    assert straggler["recommendations"] == []
    assert "is slow in" in straggler["explanation"][0]["why"]
    for finding in report["findings"]:
        assert all(rec["override"] for rec in finding["recommendations"])
