"""A crashed run is diagnosed from its files: the rank that raised, its error, step and phase, above everything else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diagnostics.crash import (
    crash_path,
    describe_site,
    is_peer_failure,
    primary_crash,
    read_crash_records,
    reported_error,
    retire_crash_records,
    write_crash_record,
)
from diagnostics.diagnosis import analyse
from diagnostics.kinds.crash import CRASHED_RUN_MIN_STEPS
from diagnostics.recommend import recommend_all
from diagnostics.report import diagnose_run
from diagnostics.telemetry import TELEMETRY_DIR
from pipelines.diagnose import main as diagnose_main
from tests.diag_fixtures import write_run

GLOO_ECHO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:2946. This is typically caused by a remote worker crashing."
)


def raised(error: Exception) -> Exception:
    try:
        raise error
    except Exception as caught:
        return caught


def set_time(run_dir: Path, rank: int, t: float) -> None:
    path = crash_path(run_dir, rank)
    path.write_text(json.dumps({**json.loads(path.read_text()), "t": t}))


def test_the_raising_rank_is_the_top_finding_with_its_error_step_and_phase(tmp_path: Path) -> None:
    analysis = analyse(write_run(tmp_path / "run", "crash", crash=(1, 8, "forward")))
    top = analysis.findings[0]
    assert (top.kind, top.severity, top.ranks) == ("crash", "critical", [1])
    assert top.cost == {"fraction": 1.0, "basis": top.cost["basis"]} and "stopped" in top.cost["basis"]
    ev = top.evidence
    assert (ev["exception"], ev["step"], ev["phase"]) == ("ValueError", 8, "forward")
    assert ev["message"] == "bad batch in training forward (deliberate)"  # the first line only
    assert ev["peer_failures"] == [0] and ev["steps_recorded"] == 7
    assert ev["raised_at"].split(":")[0].endswith("diag_fixtures.py")
    assert top.message == (
        "rank 1 raised in forward of step 8: ValueError: bad batch in training forward (deliberate); the run stopped"
    )
    assert [f.kind for f in analysis.findings].count("crash") == 1


@pytest.mark.parametrize("rank", [0, 1])
def test_an_echo_written_before_the_cause_does_not_take_the_blame(tmp_path: Path, rank: int) -> None:
    run_dir = write_run(tmp_path / "run", "crash", crash=(rank, 8, "backward"))
    set_time(run_dir, 1 - rank, 0.0)  # the survivor's clock ran ahead: its echo looks first
    (crash,) = [f for f in analyse(run_dir).findings if f.kind == "crash"]
    assert crash.ranks == [rank] and crash.evidence["phase"] == "backward"


def test_when_several_ranks_raise_their_own_error_the_first_is_the_cause(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_crash_record(run_dir, 1, raised(KeyError("late")), 4, "forward")
    write_crash_record(run_dir, 0, raised(ValueError("early")), 4, "forward")
    set_time(run_dir, 0, 100.0)
    set_time(run_dir, 1, 101.0)
    assert primary_crash(read_crash_records(run_dir))["rank"] == 0


def test_a_rank_killed_without_a_record_is_named_from_run_json(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "crash", crash=(1, 8, "forward"))
    crash_path(run_dir, 1).unlink()  # SIGKILL: the rank wrote nothing; its peer's echo remains
    manifest = json.loads((run_dir / "run.json").read_text())
    manifest.update(status="failed", failure="rank 1 died (killed by SIGKILL)", failed_rank=1)
    (run_dir / "run.json").write_text(json.dumps(manifest))
    (crash,) = [f for f in analyse(run_dir).findings if f.kind == "crash"]
    assert crash.ranks == [1] and crash.severity == "critical"
    assert crash.message == "rank 1 died (killed by SIGKILL); the run stopped"
    assert crash.evidence["peer_failures"] == [0]
    (advice,) = recommend_all(analyse(run_dir))[0]
    assert advice.override == "" and "out-of-memory killer" in advice.why

    manifest.update(failure="rank 1 hung: no step completed in 10 s after step 7", hung_ranks=[1])
    (run_dir / "run.json").write_text(json.dumps(manifest))
    assert not [f for f in analyse(run_dir).findings if f.kind == "crash" and f.ranks == [1]]  # the hang's finding

    manifest.update(status="running", failed_rank=None)  # no launcher record either: only the echo is known
    manifest.pop("hung_ranks")
    (run_dir / "run.json").write_text(json.dumps(manifest))
    (crash,) = [f for f in analyse(run_dir).findings if f.kind == "crash"]
    assert crash.ranks == [0] and "left no record" in crash.message


def test_other_findings_of_a_crashed_run_are_graded_on_what_it_measured(tmp_path: Path) -> None:
    # The same bottleneck, critical in a finished run, stays below the crash in a run that crashed.
    finished = {f.kind: f.severity for f in analyse(write_run(tmp_path / "done", "input_bound")).findings}
    assert finished["input_bound"] == "critical"
    early = analyse(write_run(tmp_path / "early", "input_bound", crash=(1, 6, "data"))).findings
    late = analyse(write_run(tmp_path / "late", "input_bound", crash=(1, CRASHED_RUN_MIN_STEPS + 6, "data"))).findings
    for found, ceiling in ((early, "info"), (late, "warning")):
        assert found[0].kind == "crash" and found[0].evidence["phase"] == "data"
        (input_bound,) = [f for f in found if f.kind == "input_bound"]
        assert input_bound.severity == ceiling
        assert input_bound.evidence["graded_before_crash"] == "critical"
        assert all(f.severity != "critical" for f in found[1:])


def test_a_finished_run_has_no_crash_finding_and_an_earlier_attempts_records_are_retired(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "healthy")
    write_crash_record(run_dir, 1, raised(ValueError("attempt 0")), 3, "forward")
    retire_crash_records(run_dir)  # what a restart in the same run dir does first
    assert read_crash_records(run_dir) == {}
    assert (run_dir / "failure_rank1.earlier.json").is_file()
    assert analyse(run_dir).findings == []


def test_a_run_that_crashed_before_any_telemetry_still_gets_a_report(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    write_crash_record(run_dir, 0, raised(ImportError("no module named 'mymodel'")), None, None)
    assert not (run_dir / TELEMETRY_DIR).exists()
    report = diagnose_run(run_dir)
    assert report.kinds() == ["crash"] and report.findings[0].ranks == [0]
    assert json.loads((run_dir / "report" / "report.json").read_text())["findings"][0]["kind"] == "crash"
    assert diagnose_main([str(run_dir)]) == 0  # python -m diagnose: the same function, the same report
    out = capsys.readouterr().out
    assert "critical crash [run stopped]: rank 0 raised ImportError: no module named 'mymodel'" in out


def test_the_crash_recommendation_points_at_the_traceback_without_an_override(tmp_path: Path) -> None:
    analysis = analyse(write_run(tmp_path / "run", "crash", crash=(1, 8, "forward")))
    (first, *_), *_ = recommend_all(analysis)
    assert first.override == "" and "failure_rank1.json" in first.why and "diag_fixtures.py" in first.why


def test_peer_failures_and_records() -> None:
    assert is_peer_failure("RuntimeError", GLOO_ECHO)
    assert is_peer_failure("RuntimeError", "[../gloo/transport/tcp/pair.cc:534] Connection reset by peer")
    assert is_peer_failure("DistBackendError", "NCCL error: remote process exited or there was a network error")
    assert not is_peer_failure("ValueError", "bad batch")
    assert not is_peer_failure("RuntimeError", "CUDA out of memory")
    assert describe_site(8, "forward") == "in forward of step 8"
    assert describe_site(8, "other") == describe_site(8, None) == "at step 8"
    assert describe_site(None, None) == ""


def test_a_ranks_first_error_is_its_record(tmp_path: Path) -> None:
    assert write_crash_record(tmp_path, 2, raised(ValueError("first")), 5, "optimizer") == crash_path(tmp_path, 2)
    assert write_crash_record(tmp_path, 2, raised(RuntimeError(GLOO_ECHO)), 5, "other") is None
    (record,) = read_crash_records(tmp_path).values()
    assert (record["rank"], record["error"], record["peer_failure"]) == (2, "ValueError: first", False)
    assert "Traceback (most recent call last)" in record["traceback"]
    crash_path(tmp_path, 3).write_text('{"rank": 3, "exc')  # torn: skipped
    assert list(read_crash_records(tmp_path)) == [2]


def test_a_pipeline_stage_wrapper_gives_way_to_the_cause_it_chains(tmp_path: Path) -> None:
    """torch's pipeline schedule re-raises a stage's error as '[Stage 1] failed to run forward:' (the arguments'
    shapes on the next lines): the record names the cause, and keeps the whole chain in the traceback."""
    try:
        try:
            raise KeyError("token 7 not in the vocabulary")
        except KeyError as cause:
            raise RuntimeError(
                "\n            [Stage 1] failed to run forward:\n            args: ('Tensor(...)',)"
            ) from cause
    except RuntimeError as wrapper:
        write_crash_record(tmp_path, 1, wrapper, 5, "forward")
    (record,) = read_crash_records(tmp_path).values()
    assert (record["exception"], record["error"]) == ("KeyError", "KeyError: 'token 7 not in the vocabulary'")
    assert "failed to run forward" in record["traceback"] and "KeyError" in record["traceback"]
    plain = raised(RuntimeError("failed to run forward: of my own"))  # a user's own message is not a wrapper
    assert reported_error(plain) is plain
