"""The fault matrix (docs/reliability.md): each fault on rank 0 and on a non-zero rank ends as documented.

Faults come from ``DISTTRAIN_FAULT`` (``disttrain/reliability/faults.py``). Every launch costs CI time, so runs
are shared: a ``nan_policy=skip`` run per layout takes a non-finite loss and a non-finite gradient on each rank,
then ends with a fault on rank 0 (DDP: ENOSPC in the last save; FSDP and Megatron: an exception). Its
checkpoints are then cut short (a file, a shard of rank 0, a shard of rank 1) and resumed from, and the resumed
run ends with another fault. The agreed non-finite stop (``nan_policy=stop``) gets a run under DDP (from rank 0)
and Megatron pp=2 (from rank 1); Megatron's stopped run is then the resume source of its rank-1 cells (SIGKILL,
hang, ENOSPC). The other faults that end a run get one run per cell not covered elsewhere (see the matrix in
docs/reliability.md: the other cells, and FSDP's stop, are in test_reliability.py and test_diagnostics_runs.py). Each
case asserts the exit code, the rank named on the console, in run.json and in the report, that no process is left
behind and which checkpoints are complete.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from diagnostics.telemetry import telemetry_path
from disttrain.checkpoint.files import discover
from tests.conftest import TINY_MODEL, load_checkpoint, read_manifest
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
USER_DATA = ["~data", "+data._target_=tests.plugins.CountingData"]
GPT = [*TINY_MODEL, "data.num_train_tokens=2048", "data.num_val_tokens=2048"]
LAYOUTS = {
    "ddp": ["strategy=ddp", *USER_MODEL, *USER_DATA],
    "fsdp": ["strategy=fsdp", *USER_MODEL, *USER_DATA],
    "megatron-pp2": ["strategy=megatron", "strategy.pp=2", *GPT],
}
RAISED = "RuntimeError: exception in forward of step {step} on rank {rank} (DISTTRAIN_FAULT)"
# The hang runs' watchdog timeout: each hang run waits it out. A step here takes milliseconds (well under a second
# at load 5 on 2 cores, the first one included), so 6 s cannot be reached by a step that is only slow.
HANG_S = 6


def checkpoints(run_dir: Path) -> list[str]:
    return [path.name for _, path in discover(run_dir / "checkpoints").complete]


def report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report" / "report.json").read_text())


def assert_failed(result: subprocess.CompletedProcess, run_dir: Path, rank: int, failure: str, code: int = 1) -> None:
    """The run ended with ``code``; the console, run.json and the report name ``rank`` and ``failure``."""
    assert result.returncode == code, result.stderr[-3000:]
    last = result.stderr.rstrip().splitlines()[-1]
    assert last == f"disttrain: {failure}; stopping the job; report: {run_dir / 'report' / 'report.md'}"
    manifest = read_manifest(run_dir)
    assert (manifest["status"], manifest["failed_rank"], manifest["failure"]) == ("failed", rank, failure)
    assert json.loads((run_dir / "failure.json").read_text())["rank"] == rank
    top = report(run_dir)["findings"][0]
    assert (top["kind"], top["ranks"]) == ("crash", [rank])
    assert survivors(run_dir) == []


def assert_raised(result: subprocess.CompletedProcess, run_dir: Path, rank: int, site: str, error: str) -> None:
    """A rank's own error: its traceback once (a chained one whole), then the one line naming it."""
    assert_failed(result, run_dir, rank, f"rank {rank} raised in {site}: {error}")
    chained = result.stderr.count("The above exception was the direct cause of the following exception")
    assert result.stderr.count("Traceback (most recent call last)") == 1 + chained


# -- non-finite loss and gradients on every rank, skipped; then a fault that ends the run: one run per layout -------
# Steps count from 1 in DISTTRAIN_FAULT; the guard numbers a step by the steps completed before it (one less).
NAN_FAULTS = "nan_loss@step=2,rank=0; nan_grad@step=4,rank=1; nan_grad@step=5,rank=0"
SKIPPED = [(1, "loss and gradients"), (3, "gradients"), (4, "gradients")]
SKIP_RUNS = {  # layout -> (the faults after NAN_FAULTS, the non-finite steps seen, where rank 0 then raises)
    "ddp": ("enospc@save=9,rank=0", SKIPPED, "checkpoint of step 9"),  # the last save fails on a full disk
    "fsdp": ("nan_loss@step=7,rank=1; raise@step=8,rank=0", [*SKIPPED, (6, "loss and gradients")], "forward of step 8"),
    # Its engine runs backward itself: a non-finite loss is caught through the gradients it makes.
    "megatron-pp2": (
        "nan_loss@step=7,rank=1; raise@step=8,rank=0",
        [(step, "gradients") for step in (1, 3, 4, 6)],
        "forward of step 8",  # wrapped by the pipeline engine: named by its cause
    ),
}


class SkipRuns(dict):
    """Each layout's skip run, launched on first use; its checkpoints are resumed from below."""

    def __init__(self, tmp: Path) -> None:
        super().__init__()
        self.tmp = tmp

    def __missing__(self, layout: str) -> tuple[Path, subprocess.CompletedProcess]:
        run_dir = self.tmp / layout
        args, fault = self.command(layout)
        self[layout] = (run_dir, launch(args, run_dir, fault=fault, timeout=240))
        return self[layout]

    def command(self, layout: str) -> tuple[list[str], str]:
        """The overrides and the faults of this layout's run."""
        ending, seen, _ = SKIP_RUNS[layout]
        args = [*STEPS, *LAYOUTS[layout], "trainer.nan_policy=skip", f"trainer.max_nan_skips={len(seen)}"]
        return args, f"{NAN_FAULTS}; {ending}"


@pytest.fixture(scope="module")
def skip_runs(tmp_path_factory: pytest.TempPathFactory) -> SkipRuns:
    return SkipRuns(tmp_path_factory.mktemp("skip"))


@pytest.mark.parametrize("layout", sorted(SKIP_RUNS))
def test_nonfinite_on_each_rank_is_skipped_then_rank_0_fails(layout: str, skip_runs: SkipRuns) -> None:
    run_dir, result = skip_runs[layout]
    _, seen, site = SKIP_RUNS[layout]
    if site.startswith("checkpoint"):
        partial = run_dir / "checkpoints" / ".partial-step000009" / "step000009.ckpt"
        error = f"OSError: [Errno 28] No space left on device: '{partial}'"
    else:
        error = RAISED.format(step=8, rank=0)
    assert_raised(result, run_dir, 0, site, error)
    for rank in (0, 1):  # every rank voted and recorded the same verdicts
        records = [json.loads(line) for line in telemetry_path(run_dir, rank).open()]
        assert [(r["step"], r["what"]) for r in records if r["kind"] == "nonfinite"] == seen
    assert checkpoints(run_dir) == ["step000003.ckpt", "step000006.ckpt"]  # none for the failed step
    if layout == "ddp":  # a skipped step leaves Adam untouched: its step count lags the global step by the skips
        for step, updates in ((3, 2), (6, 3)):
            state = load_checkpoint(run_dir / "checkpoints" / f"step{step:06d}.ckpt")
            assert state["global_step"] == step
            adam = state["optimizer_0"]
            assert {float(v) for k, v in adam.items() if k.startswith("state.") and k.endswith(".step")} == {
                float(updates)
            }
            assert all(torch.isfinite(t).all() for t in state["state_dict"].values())


# -- a corrupt newest checkpoint, resumed from, then a fault that ends the resumed run: one run per layout -----------
RESUMED = {  # layout -> (what is cut short in step 6's checkpoint, the fault, its rank)
    "ddp": ("step000006.ckpt/__1_0.distcp", "enospc@save=6,rank=1", 1),  # rank 1's part (a full disk)
    "fsdp": ("step000006.ckpt/__0_0.distcp", "sigkill@step=5,rank=0", 0),  # rank 0's shard
    "megatron-pp2": ("step000006.ckpt/__1_0.distcp", "enospc@save=6,rank=0", 0),  # rank 1's shard (stage 1)
}


@pytest.mark.parametrize("layout", sorted(RESUMED))
def test_resume_passes_over_a_corrupt_checkpoint_then_a_fault_ends_the_resumed_run(
    layout: str, skip_runs: SkipRuns, tmp_path: Path
) -> None:
    source, _ = skip_runs[layout]
    first = tmp_path / "first"
    shutil.copytree(source, first, symlinks=True)  # the skip run's own test asserts on the original
    cut, fault, rank = RESUMED[layout]
    part = first / "checkpoints" / cut
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    resumed = tmp_path / "resumed"
    result = launch([f"resume={first}"], resumed, fault=fault, timeout=240)
    # The DDP skip run's last save failed: its staging dir is passed over too.
    interrupted = ", .partial-step000009 (interrupted save)" if layout == "ddp" else ""
    assert (
        f"resuming from {first / 'checkpoints' / 'step000003.ckpt'} (the newest complete checkpoint; skipped "
        f"step000006.ckpt (incomplete){interrupted})"
    ) in result.stdout
    if fault.startswith("enospc"):
        partial = resumed / "checkpoints" / ".partial-step000006" / "step000006.ckpt"
        error = f"OSError: [Errno 28] No space left on device: '{partial}'"
        assert_raised(result, resumed, rank, "checkpoint of step 6", error)
    else:  # SIGKILL of rank 0, the launcher: the shell sees 137; rank 1 records it
        assert_failed(result, resumed, 0, "rank 0 died (killed by SIGKILL)", code=-9)
        assert "Traceback" not in result.stderr
    assert checkpoints(resumed) == []  # the resumed run failed before its first save completed
    names = sorted(p.name for p in (first / "checkpoints").glob("step*"))
    assert names == ["step000003.ckpt", "step000006.ckpt"]  # resuming deletes nothing


# -- the agreed non-finite stop (nan_policy=stop, the default), starting on rank 0 and on rank 1 -------------------
STOPS = {  # layout -> (the fault, the step the guard names: the steps completed before it, what turned non-finite)
    "ddp": ("nan_loss@step=5,rank=0", 4, "loss and gradients"),  # DDP's all-reduce spreads it to rank 1's gradients
    "megatron-pp2": ("nan_grad@step=5,rank=1", 4, "gradients"),  # the last stage's gradient only: the vote carries it
}


class StopRuns(SkipRuns):
    """Each layout's stopped run, launched on first use; Megatron's is resumed from below."""

    def command(self, layout: str) -> tuple[list[str], str]:
        return [*STEPS, *LAYOUTS[layout]], STOPS[layout][0]


@pytest.fixture(scope="module")
def stop_runs(tmp_path_factory: pytest.TempPathFactory) -> StopRuns:
    return StopRuns(tmp_path_factory.mktemp("stop"))


@pytest.mark.parametrize("layout", sorted(STOPS))
def test_a_nonfinite_stop_from_any_rank_ends_every_rank_with_exit_4(layout: str, stop_runs: StopRuns) -> None:
    """Every rank votes and stops at the same step; a non-zero rank that exits first (code 4, its marker) is not
    taken for a dead one; the launcher ends the stop: one line naming the step and the last good checkpoint."""
    run_dir, result = stop_runs[layout]
    _, step, what = STOPS[layout]
    assert result.returncode == 4, result.stderr[-3000:]
    reason = f"non-finite {what} at step {step} (nan_policy=stop)"
    last_good = run_dir / "checkpoints" / "step000003.ckpt"
    assert result.stderr.splitlines() == [  # each line once: no death, no traceback, no rank's echo
        f"disttrain: {reason}: stopping; the weights were not updated with it",
        f"disttrain: stopped: {reason}; last good checkpoint: {last_good}",
    ]
    manifest = read_manifest(run_dir)
    assert (manifest["status"], manifest.get("failure"), manifest.get("failed_rank")) == ("stopped", None, None)
    nonfinite = {
        "policy": "stop",
        "skipped_steps": [],
        "scaler_skipped_steps": [],
        "stopped_at_step": step,
        "stop_reason": reason,
    }
    assert manifest["nonfinite"] == {**nonfinite, "last_good_checkpoint": str(last_good)}
    for rank in (0, 1):  # every rank voted and recorded the same verdict
        records = [json.loads(line) for line in telemetry_path(run_dir, rank).open()]
        verdicts = [(r["step"], r["what"], r["action"]) for r in records if r["kind"] == "nonfinite"]
        assert verdicts == [(step, what, "stopped")]
    assert report(run_dir)["run_dir"] == str(run_dir) and (run_dir / "report" / "report.md").is_file()
    top = report(run_dir)["findings"][0]  # the report explains the stop: every rank agreed, the last good named
    assert (top["kind"], top["severity"], top["ranks"], top["cost"]["fraction"]) == ("nonfinite", "critical", [0, 1], 1)
    assert (top["evidence"]["stopped_at_step"], top["evidence"]["what"]) == (step, what)
    assert top["evidence"]["last_good_checkpoint"] == str(last_good) and top["evidence"]["every_rank_agreed"]
    assert survivors(run_dir) == []
    # None for the bad step, nothing half-written; the last good one loads whole, at its step, finite.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["last.ckpt", "step000003.ckpt"]
    state = load_checkpoint(last_good)
    assert state["global_step"] == 3
    assert state["state_dict"] and all(torch.isfinite(t).all() for t in state["state_dict"].values())


# -- Megatron pp=2's cells on rank 1, each resumed from the stopped run (a stopped run resumes from its last good) ---
MEGATRON_RANK1 = {  # case -> (the fault, exit code, the report's top finding)
    "sigkill": ("sigkill@step=5,rank=1", 1, "crash"),
    "hang": ("hang@step=5,rank=1", 3, "hang"),
    "enospc": ("enospc@save=6,rank=1", 1, "crash"),
}


@pytest.mark.parametrize("case", sorted(MEGATRON_RANK1))
def test_megatron_rank_1_faults_after_resuming_a_stopped_run(case: str, stop_runs: StopRuns, tmp_path: Path) -> None:
    stopped, _ = stop_runs["megatron-pp2"]
    fault, code, finding = MEGATRON_RANK1[case]
    run_dir = tmp_path / "resumed"
    args = [f"resume={stopped}", *([f"diagnostics.hang_timeout_s={HANG_S}"] if finding == "hang" else [])]
    result = launch(args, run_dir, fault=fault, timeout=240)
    assert f"resuming from {stopped / 'checkpoints' / 'step000003.ckpt'}" in result.stdout
    if case == "sigkill":  # stage 0 sees its peer's connection close: the dead rank is named, not stage 0
        assert_failed(result, run_dir, 1, "rank 1 died (killed by SIGKILL)", code=code)
        assert "Traceback" not in result.stderr
    elif case == "hang":
        assert_hung(result, run_dir, 1)
    else:
        partial = run_dir / "checkpoints" / ".partial-step000006" / "step000006.ckpt"
        error = f"OSError: [Errno 28] No space left on device: '{partial}'"
        assert_raised(result, run_dir, 1, "checkpoint of step 6", error)
    assert checkpoints(run_dir) == []  # the resumed run failed before its first save completed
    assert checkpoints(stopped) == ["step000003.ckpt"]  # resuming deletes nothing


def assert_hung(result: subprocess.CompletedProcess, run_dir: Path, rank: int) -> None:
    """The watchdog (``HANG_S``) named ``rank``, the one outside any collective, on the console, in run.json and the
    report; every rank was killed."""
    assert result.returncode == 3, result.stderr[-3000:]
    assert f"ranks not in a collective: [{rank}]" in result.stderr
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "failed" and manifest["failed_rank"] == rank
    hung = f"rank {rank} hung: no step completed in {HANG_S} s after step 4, outside any collective"
    assert manifest["failure"] == hung
    top = report(run_dir)["findings"][0]
    assert (top["kind"], top["ranks"]) == ("hang", [rank])
    assert survivors(run_dir) == []


# -- other faults that end the run: one run per cell ---------------------------------------------------------------
# (layout, fault, exit code, rank named, report finding)
ENDING = {
    "ddp-hang-rank0": ("ddp", "hang@step=5,rank=0", 3, 0, "hang"),
    "fsdp-hang-rank0": ("fsdp", "hang@step=5,rank=0", 3, 0, "hang"),
    "fsdp-hang-rank1": ("fsdp", "hang@step=5,rank=1", 3, 1, "hang"),  # rank 0 waits in a collective meanwhile
    "fsdp-raise-rank1": ("fsdp", "raise@step=5,rank=1", 1, 1, "crash"),
    "fsdp-enospc-rank0": ("fsdp", "enospc@save=6,rank=0", 1, 0, "crash"),
    "fsdp-enospc-rank1": ("fsdp", "enospc@save=6,rank=1", 1, 1, "crash"),
    "megatron-hang-rank0": ("megatron-pp2", "hang@step=5,rank=0", 3, 0, "hang"),
    "megatron-raise-rank1": ("megatron-pp2", "raise@step=5,rank=1", 1, 1, "crash"),
}


@pytest.mark.parametrize("case", sorted(ENDING))
def test_a_fault_that_ends_the_run_names_its_rank_everywhere(case: str, tmp_path: Path) -> None:
    layout, fault, code, rank, finding = ENDING[case]
    run_dir = tmp_path / "run"
    args = [*STEPS, *LAYOUTS[layout]]
    if finding == "hang":
        args.append(f"diagnostics.hang_timeout_s={HANG_S}")
    result = launch(args, run_dir, fault=fault, timeout=240)
    if finding == "hang":
        assert code == 3
        assert_hung(result, run_dir, rank)
    elif fault.startswith("raise"):
        assert_raised(result, run_dir, rank, "forward of step 5", RAISED.format(step=5, rank=rank))
    else:
        partial = run_dir / "checkpoints" / ".partial-step000006" / "step000006.ckpt"
        error = f"OSError: [Errno 28] No space left on device: '{partial}'"
        assert_raised(result, run_dir, rank, "checkpoint of step 6", error)
    assert checkpoints(run_dir) == ["step000003.ckpt"]  # the one before the fault stays the newest complete one
