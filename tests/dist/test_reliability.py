"""Runs that get killed, lose a rank, or hit a NaN: they recover exactly or stop cleanly (docs/reliability.md).

Kills are SIGKILL (nothing can catch or clean up after it) delivered at seeded points by DISTTRAIN_FAULT
(disttrain/reliability/faults.py): after an optimizer step, or inside a checkpoint save between writing and publishing.
Every run uses dropout, so a resume that did not restore every rank's RNG state would not be bitwise exact.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diagnostics.telemetry import telemetry_path
from tests.conftest import REPO, TINY_MODEL, read_manifest
from tests.dist.test_parity_and_resume import model_weights

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS, EVERY = 9, 3  # checkpoints at steps 3, 6, 9
KILL_POINTS = random.Random(20261121)
# 2048 tokens -> 64 windows of 33 -> 8 steps of 8 sequences per pass: kills land mid-epoch, runs cross one.
DATA = ["data.num_train_tokens=2048", "data.num_val_tokens=2048"]
MODEL = TINY_MODEL
TRAIN = [
    f"trainer.max_steps={STEPS}",
    f"trainer.ckpt_every_n_steps={EVERY}",
    "trainer.micro_batch_size=4",
    "trainer.log_every_n_steps=1",
    "trainer.val_every_n_steps=1000",
    "trainer.val_batches=1",
    "optimizer.warmup_steps=2",
    "optimizer.lr=1e-3",
]
COMMON = [*DATA, *MODEL, "model.dropout=0.1", *TRAIN, "diagnostics=off"]


def launch(
    args: list[str], run_dir: Path, fault: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python -m train`` as its own process tree; the timeout is the hang guard (a hang fails the test)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}
    env.pop("LOCAL_RANK", None)
    env.pop("DISTTRAIN_FAULT", None)
    if fault:
        env["DISTTRAIN_FAULT"] = fault
    command = [sys.executable, "-m", "train", *args, f"hydra.run.dir={run_dir}"]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def survivors(run_dir: Path) -> list[int]:
    """Live processes of a run (every rank's command line names its run dir)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"hydra.run.dir={run_dir}" in cmdline and state != "Z":
            found.append(int(proc.name))
    return found


def assert_launcher_death_recorded(result: subprocess.CompletedProcess, run_dir: Path) -> None:
    """Rank 0, the launcher, was SIGKILLed (the shell sees 137); rank 1 went down with it and recorded it."""
    assert result.returncode == -9, result.stderr[-2000:]
    assert result.stderr.rstrip().splitlines()[-1].startswith("disttrain: rank 0 died (killed by SIGKILL); stopping")
    manifest = read_manifest(run_dir)
    assert (manifest["status"], manifest["failed_rank"]) == ("failed", 0)
    assert survivors(run_dir) == []


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return model_weights(run_dir / "checkpoints" / f"step{STEPS:06d}.ckpt")


def assert_bitwise_equal(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected and sorted(expected) == sorted(actual)
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), f"{name} differs from the uninterrupted run"


def ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


class Uninterrupted(dict):
    """Final weights of an uninterrupted run per strategy, run on first use."""

    def __init__(self, tmp: Path) -> None:
        super().__init__()
        self.tmp = tmp

    def __missing__(self, strategy: str) -> dict[str, torch.Tensor]:
        run_dir = self.tmp / strategy
        ok(launch([*COMMON, f"strategy={strategy}"], run_dir))
        self[strategy] = final_weights(run_dir)
        return self[strategy]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Uninterrupted:
    return Uninterrupted(tmp_path_factory.mktemp("uninterrupted"))


# A kill after a step is also covered by the rank-death and restart tests below; mid-save is the hard case.
@pytest.mark.parametrize("where", ["save"])
def test_sigkill_then_resume_is_bitwise_exact_ddp(where: str, reference: dict, tmp_path: Path) -> None:
    """Rank 0 (the launcher) is SIGKILLed mid-epoch or mid-save; its child records it and dies with it; resume is
    exact."""
    if where == "step":
        point = KILL_POINTS.randint(EVERY + 1, STEPS - 1)
        newest = point // EVERY * EVERY
    else:
        point = KILL_POINTS.choice(range(2 * EVERY, STEPS, EVERY))
        newest = point - EVERY  # the save in progress never became a checkpoint
    killed = tmp_path / "killed"
    result = launch([*COMMON, "strategy=ddp"], killed, fault=f"sigkill@{where}={point},rank=0")
    assert_launcher_death_recorded(result, killed)
    if where == "save":
        assert (killed / "checkpoints" / f".partial-step{point:06d}").is_dir()
        assert not (killed / "checkpoints" / f"step{point:06d}.ckpt").exists()

    resumed = tmp_path / "resumed"
    result = launch([f"resume={killed}"], resumed)
    ok(result)
    assert f"resuming from {killed / 'checkpoints' / f'step{newest:06d}.ckpt'}" in result.stdout
    if where == "save":
        assert f"skipped .partial-step{point:06d} (interrupted save)" in result.stdout
    assert_bitwise_equal(reference["ddp"], final_weights(resumed))


# (strategy overrides, where the kill lands): pipeline stages with a tied embedding and a DCP checkpoint, killed
# in the launcher (rank 0) mid-save; ZeRO-2's per-rank optimizer partitions, rank 1 killed after a step.
OTHER_STRATEGIES = {
    "megatron-pp2": (["strategy=megatron", "strategy.pp=2"], "save"),
    "deepspeed-zero2": (["strategy=deepspeed", "strategy.stage=2"], "step"),
}


def strategy_weights(run_dir: Path, name: str) -> dict[str, torch.Tensor]:
    if name.startswith("deepspeed"):
        from tests.dist.test_deepspeed import full_weights

        return full_weights(run_dir, STEPS)
    return final_weights(run_dir)


@pytest.mark.parametrize("name", sorted(OTHER_STRATEGIES))
def test_rank_killed_mid_run_then_resume_is_bitwise_exact_megatron_deepspeed(name: str, tmp_path: Path) -> None:
    """The same guarantee for the strategies with their own checkpoint formats and training loops."""
    overrides, where = OTHER_STRATEGIES[name]
    uninterrupted = tmp_path / "uninterrupted"
    ok(launch([*COMMON, *overrides], uninterrupted))
    point = KILL_POINTS.randint(EVERY + 1, STEPS - 1) if where == "step" else 2 * EVERY
    rank = 1 if where == "step" else 0
    killed = tmp_path / "killed"
    result = launch([*COMMON, *overrides], killed, fault=f"sigkill@{where}={point},rank={rank}", timeout=120)
    if rank == 1:
        assert result.returncode == 1 and "rank 1 died (killed by SIGKILL)" in result.stderr
    else:
        assert_launcher_death_recorded(result, killed)
        assert not (killed / "checkpoints" / f"step{point:06d}.ckpt").exists()  # the save never published
    assert survivors(killed) == []
    resumed = tmp_path / "resumed"
    result = launch([f"resume={killed}"], resumed)
    ok(result)
    newest = point // EVERY * EVERY if where == "step" else point - EVERY
    assert f"resuming from {killed / 'checkpoints' / f'step{newest:06d}.ckpt'}" in result.stdout
    assert_bitwise_equal(strategy_weights(uninterrupted, name), strategy_weights(resumed, name))


def test_rank_death_fails_fast_naming_the_rank_fsdp(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed after a step: named, no traceback, nothing left. (Its resume is not repeated here: the kill
    leaves the checkpoints before it as they were, and resuming an FSDP run from a mid-run checkpoint is bitwise
    exact, tests/dist/test_parity_and_resume.py.)"""
    point = KILL_POINTS.randint(EVERY + 1, STEPS - 1)
    failed = tmp_path / "failed"
    result = launch([*COMMON, "strategy=fsdp"], failed, fault=f"sigkill@step={point},rank=1", timeout=120)
    assert result.returncode == 1
    assert "disttrain: rank 1 died (killed by SIGKILL); stopping the job" in result.stderr
    assert "Traceback" not in result.stderr
    assert survivors(failed) == []
    manifest = read_manifest(failed)
    assert manifest["status"] == "failed" and manifest["failure"] == "rank 1 died (killed by SIGKILL)"
    newest = point // EVERY * EVERY
    assert sorted(p.name for p in (failed / "checkpoints").glob("step*")) == [
        f"step{step:06d}.ckpt" for step in range(EVERY, newest + 1, EVERY)
    ]


def test_elastic_restart_resumes_in_the_same_run_dir(reference: dict, tmp_path: Path) -> None:
    point = KILL_POINTS.randint(EVERY + 1, STEPS - 1)
    run_dir = tmp_path / "run"
    result = launch([*COMMON, "strategy=ddp", "trainer.max_restarts=1"], run_dir, fault=f"sigkill@step={point},rank=1")
    ok(result)
    assert "rank 1 died (killed by SIGKILL)" in result.stderr
    assert "restart 1 of 1" in result.stderr
    assert f"restart 1: resuming from {run_dir / 'checkpoints' / f'step{point // EVERY * EVERY:06d}.ckpt'}" in (
        result.stdout
    )
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "completed" and manifest["restart_attempt"] == 1
    assert survivors(run_dir) == []
    assert_bitwise_equal(reference["ddp"], final_weights(run_dir))
    # The restart's metrics.csv holds its own steps. Whether the killed attempt flushed its CSV at all depends on
    # which of rank 0's two ways of noticing the dead rank wins (Lightning's teardown flushes, the watcher's
    # os._exit does not), so its metrics_attempt0.csv is asserted where it is deterministic: the SLURM requeue test.
    logged = logged_steps(run_dir / "metrics" / "metrics.csv")
    assert min(logged) == point // EVERY * EVERY and max(logged) == STEPS - 1


def logged_steps(metrics: Path) -> set[int]:
    """The (0-based) steps a CSV metrics file has a train loss for."""
    import csv

    with metrics.open() as handle:
        return {int(row["step"]) for row in csv.DictReader(handle) if row.get("train/loss")}


NAN_MODEL = [
    "~model",
    "+model._target_=tests.plugins.InfAtStepModel",
    "+model.vocab_size=16",
    "+model.seq_len=16",
    "+model.inf_rank=1",
]


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_nonfinite_stop_keeps_last_good_checkpoint(strategy: str, tmp_path: Path) -> None:
    """The loss turns NaN on rank 1 only; every rank stops, by the guard's vote. Rank 0's teardown is slow
    (SlowTeardownData), so rank 1 has exited 4 before the launcher has finished fit: a stopping rank must not be taken
    for a dead one."""
    run_dir = tmp_path / "run"
    slow_teardown = ["~data", "+data._target_=tests.plugins.SlowTeardownData"]
    args = [*TRAIN, *slow_teardown, f"strategy={strategy}", *NAN_MODEL, "+model.inf_steps=[5]"]
    # Diagnostics on (cheaply) so the telemetry and the report are written as in a real run.
    args += ["diagnostics.calibrate=false", "diagnostics.profile=false"]
    result = launch(args, run_dir)
    assert result.returncode == 4, result.stderr[-3000:]
    assert "non-finite loss and gradients at step 5 (nan_policy=stop)" in result.stderr
    assert f"last good checkpoint: {run_dir / 'checkpoints' / 'step000003.ckpt'}" in result.stderr
    assert "Traceback" not in result.stderr and "died" not in result.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step*")) == ["step000003.ckpt"]
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "stopped"
    assert manifest["nonfinite"]["stopped_at_step"] == 5
    for rank in (0, 1):  # every rank voted and recorded it
        records = [json.loads(line) for line in telemetry_path(run_dir, rank).open()]
        assert [r["step"] for r in records if r["kind"] == "nonfinite"] == [5]
    assert (run_dir / "report" / "report.md").is_file()
    assert survivors(run_dir) == []


ONE_PROCESS = [
    *TRAIN,
    "hw.devices_per_node=1",
    "diagnostics.calibrate=false",
    "diagnostics.profile=false",
    "~model",
    "+model._target_=tests.plugins.BigramModel",
    "+model.vocab_size=16",
    "+model.seq_len=16",
]


def assert_signal_end_recorded(
    result: subprocess.CompletedProcess, run_dir: Path, code: int, how: str, rank: int = 0
) -> None:
    """A run ended by a signal: the shell sees ``code``; one line, run.json, failure.json and the report name
    ``rank`` and ``how`` it ended."""
    assert result.returncode == code, result.stderr[-3000:]
    report_md = run_dir / "report" / "report.md"
    last = f"disttrain: rank {rank} {how}; stopping the job; report: {report_md}"
    assert result.stderr.rstrip().splitlines()[-1] == last
    assert "Traceback" not in result.stderr
    manifest = read_manifest(run_dir)
    assert (manifest["status"], manifest["failed_rank"], manifest["failure"]) == ("failed", rank, f"rank {rank} {how}")
    assert json.loads((run_dir / "failure.json").read_text())["rank"] == rank
    top = json.loads((run_dir / "report" / "report.json").read_text())["findings"][0]
    assert (top["kind"], top["ranks"]) == ("crash", [rank])
    assert survivors(run_dir) == []


def sigterm_after_step_3(args: list[str], run_dir: Path, rank: int) -> subprocess.CompletedProcess:
    """Launch ``python -m train`` and send SIGTERM to local rank ``rank`` once step 3's console line is out."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}
    env.pop("LOCAL_RANK", None)
    env.pop("DISTTRAIN_FAULT", None)
    command = [sys.executable, "-m", "train", *args, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        for line in proc.stdout:  # type: ignore[union-attr]
            seen.append(line)
            if line.startswith("step 3/"):
                (pid,) = [proc.pid] if rank == 0 else [p for p in survivors(run_dir) if p != proc.pid]
                os.kill(pid, signal.SIGTERM)
                break
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(command, proc.returncode, "".join(seen) + stdout, stderr)


def test_a_one_process_run_stopped_by_sigterm_records_it(tmp_path: Path) -> None:
    """Lightning turns SIGTERM into a SystemExit without a code: without disttrain's handling the run exited 0
    with run.json still ``running``. Signalled mid-run (after the third step's console line), it ends with 143."""
    run_dir = tmp_path / "run"
    args = [*ONE_PROCESS, "trainer.max_steps=30", "~data", "+data._target_=tests.plugins.SlowCountingData"]
    result = sigterm_after_step_3(args, run_dir, rank=0)
    assert_signal_end_recorded(result, run_dir, 128 + signal.SIGTERM, "stopped by SIGTERM")
    assert "done:" not in result.stdout  # it did not run on to the end


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step_and_names_it(tmp_path: Path) -> None:
    """The signalled rank's flag rides in the per-step vote (reliability/sigterm.py): Lightning's own broadcast
    from inside its handler hung this 2-rank run when rank 1 alone was signalled."""
    run_dir = tmp_path / "run"
    two_ranks = [a for a in ONE_PROCESS if a != "hw.devices_per_node=1"]
    args = [*two_ranks, "trainer.max_steps=30", "~data", "+data._target_=tests.plugins.SlowCountingData"]
    result = sigterm_after_step_3(args, run_dir, rank=1)
    assert_signal_end_recorded(result, run_dir, 128 + signal.SIGTERM, "stopped by SIGTERM", rank=1)
    assert "done:" not in result.stdout
    last_steps = set()
    for rank in (0, 1):
        records = [json.loads(line) for line in telemetry_path(run_dir, rank).read_text().splitlines()]
        last_steps.add(max(r["step"] for r in records if r["kind"] == "step"))
    assert len(last_steps) == 1 and 3 <= last_steps.pop() < 30, "the ranks stopped after different steps"


def test_saved_files_hold_no_secret_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A credential pulled into the config (by interpolation or literally) is redacted in everything written.

    The run (1 process) is SIGKILLed after its last step: nothing of it is left to record that, so its torch-free
    reporter does (run.json failed, failure.json, the report), and what that reporter writes is checked too."""
    env_secret, literal_secret = "wandb-0123456789abcdef", "literal-s3cr3t-value"
    monkeypatch.setenv("WANDB_API_KEY", env_secret)
    run_dir = tmp_path / "run"
    args = [
        *DATA,
        *TRAIN,
        "trainer.max_steps=3",
        "hw.devices_per_node=1",
        "diagnostics.calibrate=false",
        "diagnostics.profile=false",
        "~model",
        "+model._target_=tests.plugins.BigramModelWithCredentials",
        "+model.vocab_size=16",
        "+model.seq_len=16",
        "+model.note=${oc.env:WANDB_API_KEY}",
        f"+model.api_token={literal_secret}",
    ]
    result = launch(args, run_dir, fault="sigkill@step=3,rank=0")
    assert_signal_end_recorded(result, run_dir, -signal.SIGKILL, "died (killed by SIGKILL)")
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    names = {str(p.relative_to(run_dir)) for p in written}
    assert {"config.yaml", "run.json", ".hydra/overrides.yaml", "train.log", "report/report.html"} <= names
    for path in written:
        content = path.read_bytes()
        assert env_secret.encode() not in content, path
        assert literal_secret.encode() not in content, path
    config = read_manifest(run_dir)["config"]["model"]
    assert config["note"] == "<redacted $WANDB_API_KEY>" and config["api_token"] == "<redacted>"
