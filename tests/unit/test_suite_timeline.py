"""benchmarks/suite_timeline.py: the idle time of the suite's workers, read from the timeline the suite writes."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.suite_timeline import Protocol, blocker, read_timeline, summarize
from tests.scheduling import record_timeline


def test_the_suite_writes_one_line_per_protocol_and_the_report_names_who_waited_behind_whom(
    tmp_path: Path, monkeypatch
) -> None:
    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv("DISTTRAIN_SUITE_TIMELINE", str(path))
    for worker, test, exclusive, asked, started, ended in [
        ("gw0", "tests/dist/test_a.py::test_long_launch", False, 0.0, 0.0, 50.0),
        ("gw1", "tests/dist/test_b.py::test_timed", True, 10.0, 50.0, 60.0),  # waited 40 s behind test_long_launch
        ("gw0", "tests/dist/test_a.py::test_after", False, 50.0, 60.0, 65.0),  # waited 10 s behind test_timed
        ("gw1", "tests/unit/test_c.py::test_quick", False, 60.0, 60.0, 61.0),
    ]:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        record_timeline(test, exclusive, asked, started, ended)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["worker"] for line in lines] == ["gw0", "gw1", "gw0", "gw1"]

    protocols = read_timeline(path)
    timed = next(p for p in protocols if p.test.endswith("test_timed"))
    after = next(p for p in protocols if p.test.endswith("test_after"))
    assert (timed.waited, timed.ran) == (40.0, 10.0)
    assert blocker(timed, protocols).test.endswith("test_long_launch")  # type: ignore[union-attr]
    assert blocker(after, protocols).test.endswith("test_timed")  # type: ignore[union-attr]

    report = summarize(protocols, top=5)
    assert report.splitlines()[0] == "suite wall 65 s, 4 tests"
    assert "gw0: ran 55 s, waited for the lock 10 s, done 0 s before the end" in report
    assert "gw1: ran 11 s, waited for the lock 40 s, done 4 s before the end" in report
    assert "exclusive tests: 1, ran 10 s alone" in report
    assert "waits over 1 s: 2, 50 s in all; longest:" in report
    assert (
        "  40.0 s  exclusive tests/dist/test_b.py::test_timed  behind tests/dist/test_a.py::test_long_launch (50 s)"
        in report
    )
    assert "    55.0 s  tests/dist/test_a.py" in report


def test_without_the_variable_nothing_is_written(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("DISTTRAIN_SUITE_TIMELINE", raising=False)
    monkeypatch.chdir(tmp_path)
    record_timeline("tests/unit/test_x.py::test_y", False, 0.0, 0.0, 1.0)
    assert list(tmp_path.iterdir()) == []


def test_a_wait_with_no_other_worker_running_has_no_blocker() -> None:
    alone = Protocol("gw0", "tests/unit/test_x.py::test_y", True, 0.0, 2.0, 3.0)
    assert blocker(alone, [alone]) is None
