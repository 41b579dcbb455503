"""The fault matrix (README, "Reliability"): each fault on rank 0 and on a non-zero rank ends as documented.

Faults come from ``DISTTRAIN_FAULT`` (``disttrain/reliability/faults.py``). To keep CI time flat, the faults that
do not end a run share one: a ``nan_policy=skip`` run takes a non-finite loss and a non-finite gradient on each
rank, then stops (the same stop as ``nan_policy=stop``) on a non-zero rank, while rank 0 is still tearing down
(the race of a stopping rank taken for a dead one). Faults that end a run get one run per cell not already
covered elsewhere (see the matrix in README: the other cells are in test_reliability.py and
test_diagnostics_runs.py). Every case asserts the exit code, the rank named on the console, in run.json and
in the report, that no process is left behind and which checkpoint is the newest complete one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diagnostics.telemetry import telemetry_path
from disttrain.checkpoint.files import discover
from tests.conftest import TINY_MODEL, read_manifest
from tests.dist.test_reliability import launch, survivors

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = [
    "trainer.max_steps=9",
    "trainer.ckpt_every_n_steps=3",
    "trainer.micro_batch_size=4",
    "trainer.log_every_n_steps=1",
    "trainer.val_every_n_steps=1000",
    "trainer.val_batches=1",
    "optimizer.warmup_steps=2",
    "diagnostics.calibrate=false",
    "diagnostics.profile=false",
]
USER_MODEL = ["~model", "+model._target_=tests.plugins.BigramModel", "+model.vocab_size=10", "+model.seq_len=16"]
# Rank 0's teardown is slow: the other ranks have finished and exited before the launcher has finished fit.
SLOW_TEARDOWN_DATA = ["~data", "+data._target_=tests.plugins.SlowTeardownData"]
GPT = [*TINY_MODEL, "data.num_train_tokens=2048", "data.num_val_tokens=2048"]
LAYOUTS = {
    "ddp": ["strategy=ddp", *USER_MODEL, *SLOW_TEARDOWN_DATA],
    "fsdp": ["strategy=fsdp", *USER_MODEL, *SLOW_TEARDOWN_DATA],
    "megatron-pp2": ["strategy=megatron", "strategy.pp=2", *GPT],
}


def checkpoints(run_dir: Path) -> list[str]:
    return [path.name for _, path in discover(run_dir / "checkpoints").complete]


def report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report" / "report.json").read_text())


# -- non-finite loss and gradients: every rank, one run per layout ------------------------------------------------
# Steps count from 1 in DISTTRAIN_FAULT; the guard numbers a step by the steps completed before it (one less).
NAN_FAULTS = "nan_loss@step=2,rank=0; nan_grad@step=4,rank=1; nan_grad@step=5,rank=0; nan_loss@step=8,rank=1"
NAN_SEEN = [(1, "loss and gradients"), (3, "gradients"), (4, "gradients"), (7, "loss and gradients")]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_nonfinite_on_each_rank_is_skipped_then_a_stop_on_rank_1_ends_as_documented(layout: str, tmp_path: Path):
    run_dir = tmp_path / "run"
    faults, seen = NAN_FAULTS, NAN_SEEN
    if layout.startswith("megatron"):
        # Its engine runs backward itself: no after-backward hook to corrupt a gradient in, and no before-backward
        # hook to check the loss in: a non-finite loss is caught through the gradients it makes.
        faults = "nan_loss@step=2,rank=0; nan_loss@step=8,rank=1"
        seen = [(1, "gradients"), (7, "gradients")]
    skips = len(seen) - 1
    args = [*STEPS, *LAYOUTS[layout], "trainer.nan_policy=skip", f"trainer.max_nan_skips={skips}"]
    result = launch(args, run_dir, fault=faults, timeout=240)
    assert result.returncode == 4, result.stderr[-3000:]
    last_good = run_dir / "checkpoints" / "step000006.ckpt"
    assert result.stderr.rstrip().splitlines()[-1] == (
        f"disttrain: stopped: non-finite {seen[-1][1]} at step 7 (more than trainer.max_nan_skips={skips}); "
        f"last good checkpoint: {last_good}"
    )
    assert "died" not in result.stderr and "Traceback" not in result.stderr
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "stopped"
    assert manifest["nonfinite"]["skipped_steps"] == [step for step, _ in seen[:-1]]
    assert manifest["nonfinite"]["stopped_at_step"] == 7
    for rank in (0, 1):  # every rank voted and recorded the same verdicts
        records = [json.loads(line) for line in telemetry_path(run_dir, rank).open()]
        assert [(r["step"], r["what"]) for r in records if r["kind"] == "nonfinite"] == seen
    assert (run_dir / "report" / "report.md").is_file()
    assert checkpoints(run_dir) == ["step000003.ckpt", "step000006.ckpt"]  # none for the stopping step
    assert survivors(run_dir) == []


# -- faults that end the run: one run per cell ---------------------------------------------------------------------
# (layout, fault, exit code, rank named, the run's last line after "disttrain: ", report finding)
ENDING = {
    "ddp-hang-rank0": ("ddp", "hang@step=5,rank=0", 3, 0, "hang"),
    "ddp-enospc-rank0": ("ddp", "enospc@save=6,rank=0", 1, 0, "crash"),
    "fsdp-raise-rank1": ("fsdp", "raise@step=5,rank=1", 1, 1, "crash"),
    "fsdp-enospc-rank1": ("fsdp", "enospc@save=6,rank=1", 1, 1, "crash"),
    "megatron-raise-rank1": ("megatron-pp2", "raise@step=5,rank=1", 1, 1, "crash"),
}


@pytest.mark.parametrize("case", sorted(ENDING))
def test_a_fault_that_ends_the_run_names_its_rank_everywhere(case: str, tmp_path: Path) -> None:
    layout, fault, code, rank, finding = ENDING[case]
    run_dir = tmp_path / "run"
    args = [*STEPS, *LAYOUTS[layout]]
    if finding == "hang":
        args.append("diagnostics.hang_timeout_s=10")
    result = launch(args, run_dir, fault=fault, timeout=240)
    assert result.returncode == code, result.stderr[-3000:]
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "failed" and manifest["failed_rank"] == rank
    if finding == "hang":
        assert f"ranks not in a collective: [{rank}]" in result.stderr
        hung = f"rank {rank} hung: no step completed in 10 s after step 4, outside any collective"
        assert manifest["failure"] == hung
    else:
        partial = run_dir / "checkpoints" / ".partial-step000006" / "step000006.ckpt"
        site, error = {
            "raise": ("forward of step 5", f"RuntimeError: exception in forward of step 5 on rank {rank}"),
            "enospc": ("checkpoint of step 6", f"OSError: [Errno 28] No space left on device: '{partial}'"),
        }[fault.partition("@")[0]]
        last = result.stderr.rstrip().splitlines()[-1]
        tracebacks = 1
        if layout.startswith("megatron"):  # the pipeline engine wraps a stage's error: the cause is chained to it
            error = "RuntimeError: [Stage 1] failed to run forward:"
            assert f"RuntimeError: exception in forward of step 5 on rank {rank}" in result.stderr
            assert result.stderr.count("The above exception was the direct cause of the following exception") == 1
            tracebacks = 2
        assert last.startswith(f"disttrain: rank {rank} raised in {site}: {error}"), last
        assert last.endswith(f"; stopping the job; report: {run_dir / 'report' / 'report.md'}")
        assert result.stderr.count("Traceback (most recent call last)") == tracebacks  # printed once
        assert manifest["failure"] == last.removeprefix("disttrain: ").split("; stopping the job")[0]
    top = report(run_dir)["findings"][0]
    assert (top["kind"], top["ranks"]) == (finding, [rank])
    assert checkpoints(run_dir) == ["step000003.ckpt"]  # the one before the fault stays the newest complete one
    assert survivors(run_dir) == []


# -- corrupt newest checkpoints on resume: a shard of rank 1, and one of rank 0, cut short ---------------------------
def test_resume_passes_over_checkpoints_with_a_shard_cut_short_fsdp(tmp_path: Path) -> None:
    first = tmp_path / "first"
    assert launch([*STEPS, *LAYOUTS["fsdp"]], first, timeout=240).returncode == 0
    for step, rank in ((9, 1), (6, 0)):  # a full disk, a partial copy
        shard = first / "checkpoints" / f"step{step:06d}.ckpt" / f"__{rank}_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    resumed = tmp_path / "resumed"
    result = launch([f"resume={first}"], resumed, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"resuming from {first / 'checkpoints' / 'step000003.ckpt'} (the newest complete checkpoint; skipped "
        "step000006.ckpt (incomplete), step000009.ckpt (incomplete))"
    ) in result.stdout
    assert read_manifest(resumed)["status"] == "completed"
    assert checkpoints(resumed) == ["step000006.ckpt", "step000009.ckpt"]
    names = sorted(p.name for p in (first / "checkpoints").glob("step*"))
    assert names == ["step000003.ckpt", "step000006.ckpt", "step000009.ckpt"]  # resuming deletes nothing
    assert survivors(resumed) == []
