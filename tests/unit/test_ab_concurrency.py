"""Two ``diagnose RUN --ab --run`` of one run at once: each gets its own set dir, and the merged verdict keeps
both sets (diagnostics/ab runner.claim_set_dir, verdict.write_verdict)."""

from __future__ import annotations

import fcntl
import multiprocessing
import threading
from pathlib import Path

from diagnostics.ab.runner import AB_DIR, AbSet, Arm, ArmRuns, RunOutcome, claim_set_dir
from diagnostics.ab.verdict import MERGE_LOCK, read_verdict, write_verdict


def _claim(run_dir: str, barrier: multiprocessing.synchronize.Barrier, results: multiprocessing.Queue) -> None:
    barrier.wait()
    results.put(claim_set_dir(Path(run_dir)).name)


def test_ab_runs_started_at_once_each_claim_their_own_set(tmp_path: Path) -> None:
    (tmp_path / AB_DIR / "set1").mkdir(parents=True)  # an earlier A/B's
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(5), ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(str(tmp_path), barrier, results)) for _ in range(5)]
    for proc in procs:
        proc.start()
    names = sorted(results.get(timeout=30) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    assert names == ["set2", "set3", "set4", "set5", "set6"]


def one_set(run_dir: Path, name: str, override: str) -> AbSet:
    set_dir = run_dir / AB_DIR / name
    set_dir.mkdir(parents=True)
    a = ArmRuns(
        Arm("A", "original", ()), {1: RunOutcome(set_dir / "01-A", 1000.0), 2: RunOutcome(set_dir / "02-A", 1010.0)}
    )
    b = ArmRuns(Arm("B1", override, (override,)))
    b.rounds = {1: RunOutcome(set_dir / "01-B1", 1500.0), 2: RunOutcome(set_dir / "02-B1", 1490.0)}
    return AbSet(set_dir, [a, b], rounds=2)


def test_the_merged_verdict_waits_for_an_ab_merging_at_the_same_moment(tmp_path: Path) -> None:
    write_verdict(one_set(tmp_path, "set1", "trainer.num_threads=1"), tmp_path)
    second = one_set(tmp_path, "set2", "trainer.micro_batch_size=8")
    # Another A/B is between reading the merged verdict and writing it back: this one must not write meanwhile.
    with (tmp_path / AB_DIR / MERGE_LOCK).open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        writer = threading.Thread(target=write_verdict, args=(second, tmp_path))
        writer.start()
        writer.join(timeout=0.5)
        assert writer.is_alive()
        assert (second.set_dir / "verdict.json").exists()  # its own set's files need no lock
        assert read_verdict(tmp_path)["sets"] == ["set1"]
    writer.join(timeout=10)
    merged = read_verdict(tmp_path)
    assert merged["sets"] == ["set1", "set2"]
    assert {v["override"] for v in merged["recommendations"]} == {"trainer.num_threads=1", "trainer.micro_batch_size=8"}
