"""Checkpoint files, resume discovery, RNG capture, the non-finite guard, faults and redaction (processes: only a
few one-line children for the launcher's watch)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from disttrain.checkpoint.files import (
    checkpoint_name,
    discover,
    is_complete,
    publish,
    record_sizes,
    remove_partials,
    staging_dir,
    to_delete_for_retention,
)
from disttrain.checkpoint.resume import find_resume_point
from disttrain.checkpoint.rng import capture, restore
from disttrain.config.errors import ConfigError
from disttrain.data.datamodule import TokenDataModule
from disttrain.job.launcher_death import describe_launcher_death, record_launcher_death, wants_report
from disttrain.job.redaction import redact, secret_values
from disttrain.launch.local import LocalRanks, describe_exit, exit_status_of_dead_process
from disttrain.reliability.faults import Fault, faults_from_env, parse_fault
from disttrain.reliability.nan_guard import (
    MAX_SCALER_OVERFLOWS,
    NonFiniteGuard,
    agreed_stop,
    retire_stop_markers,
    write_stop_marker,
)


def save(path: Path, step: int) -> Path:
    torch.save({"global_step": step, "w": torch.zeros(4)}, path)
    return path


def test_completeness_of_files_and_directories(tmp_path: Path) -> None:
    whole = save(tmp_path / "whole.ckpt", 1)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(whole.read_bytes()[:-40])  # a save killed before the zip's central directory
    assert is_complete(whole) and not is_complete(cut)
    dcp = tmp_path / "dcp.ckpt"
    (dcp).mkdir()
    (dcp / "__0_0.distcp").write_bytes(b"shard")
    assert not is_complete(dcp)  # shards without the index torch.distributed.checkpoint writes last
    (dcp / ".metadata").write_bytes(b"index")
    assert is_complete(dcp)
    (dcp / "__1_0.distcp").write_bytes(b"rank 1's shard")
    record_sizes(dcp)
    assert is_complete(dcp)
    (dcp / "__1_0.distcp").write_bytes(b"rank 1's")  # cut short after the save: a full disk, a partial copy
    assert not is_complete(dcp)
    (dcp / "__1_0.distcp").unlink()
    assert not is_complete(dcp)


def test_publish_moves_sidecars_first_and_replaces_a_directory(tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    for attempt in range(2):  # the second publish of the same step replaces the first (a restarted run)
        staging = staging_dir(ckpts, 6)
        (staging / "step000006.ckpt").mkdir(parents=True)
        (staging / "step000006.ckpt" / ".metadata").write_text(str(attempt))
        (staging / "step000006.powersgd").mkdir()
        (staging / "step000006.powersgd" / "rank00001.pt").write_text(str(attempt))
        assert publish(staging, ckpts, "step000006.ckpt") == ckpts / "step000006.ckpt"
        assert not staging.exists()
        assert (ckpts / "step000006.ckpt" / ".metadata").read_text() == str(attempt)
        assert (ckpts / "step000006.powersgd" / "rank00001.pt").read_text() == str(attempt)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step000006.ckpt", "step000006.powersgd"]


def test_discovery_skips_incomplete_and_interrupted_saves(tmp_path: Path) -> None:
    for step in (3, 6):
        save(tmp_path / checkpoint_name(step), step)
    (tmp_path / checkpoint_name(9)).write_bytes(b"PK\x03\x04 cut off")
    (staging_dir(tmp_path, 12) / checkpoint_name(12)).mkdir(parents=True)
    found = discover(tmp_path)
    assert [s for s, _ in found.complete] == [3, 6]
    assert found.skipped == [(9, "step000009.ckpt (incomplete)"), (12, ".partial-step000012 (interrupted save)")]
    assert remove_partials(tmp_path) == [staging_dir(tmp_path, 12)]


def test_resume_names_what_it_passed_over(tmp_path: Path) -> None:
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    save(ckpts / checkpoint_name(3), 3)
    staging_dir(ckpts, 6).mkdir()
    point = find_resume_point(str(tmp_path / "run"))
    assert point.checkpoint == (ckpts / "step000003.ckpt").resolve()
    assert point.describe().endswith("(the newest complete checkpoint; skipped .partial-step000006 (interrupted save))")
    cut = ckpts / checkpoint_name(9)
    cut.write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match="not a complete checkpoint") as info:
        find_resume_point(str(cut))
    assert info.value.key == "resume"


def test_retention_keeps_the_newest_n_with_their_sidecars(tmp_path: Path) -> None:
    for step in (3, 6, 9):
        save(tmp_path / checkpoint_name(step), step)
        (tmp_path / f"step{step:06d}.powersgd").mkdir()
    doomed = to_delete_for_retention(discover(tmp_path), keep_last_n=1)
    names = [p.name for p in doomed]
    # Each checkpoint goes before its sidecar: a kill in between leaves a stray sidecar, not a broken checkpoint.
    assert names == ["step000003.ckpt", "step000003.powersgd", "step000006.ckpt", "step000006.powersgd"]
    assert to_delete_for_retention(discover(tmp_path), keep_last_n=None) == []
    assert to_delete_for_retention(discover(tmp_path), keep_last_n=5) == []


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    torch.save({"rng_states": [capture()]}, tmp_path / "c.ckpt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.rand(5), np.random.rand(5), random.random()  # move every generator on
    restore(torch.load(tmp_path / "c.ckpt", weights_only=True)["rng_states"][0])
    actual = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], actual[0]) and np.array_equal(expected[1], actual[1])
    assert expected[2] == actual[2]


def test_data_position_survives_a_change_of_global_batch() -> None:
    saved = TokenDataModule.__new__(TokenDataModule)
    saved.trainer, saved.global_batch_size, saved.seed, saved._restored = SimpleNamespace(global_step=10), 8, 1, None
    state = saved.state_dict()
    assert state == {"samples_consumed": 80, "global_step": 10, "seed": 1}
    resumed = TokenDataModule.__new__(TokenDataModule)
    resumed.trainer, resumed.global_batch_size, resumed._restored = SimpleNamespace(global_step=10), 16, None
    resumed.load_state_dict(state)
    assert resumed.samples_consumed() == 80  # not 10 x 16
    resumed.trainer.global_step = 12
    assert resumed.samples_consumed() == 80 + 2 * 16


class Stub(SimpleNamespace):
    """The few Trainer attributes the guard reads."""


def guard_step(guard: NonFiniteGuard, model: nn.Module, step: int, loss: float, grad: float) -> Stub:
    trainer = Stub(strategy=Stub(root_device=torch.device("cpu")), global_step=step, is_global_zero=True)
    trainer.should_stop = False
    for p in model.parameters():
        p.grad = torch.full_like(p, grad)
    guard.on_before_backward(trainer, model, torch.tensor(loss))  # type: ignore[arg-type]
    guard.on_before_optimizer_step(trainer, model, None)  # type: ignore[arg-type]
    return trainer


@pytest.mark.parametrize("clip_norm", [None, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gradient_check_is_exact_for_every_dtype(dtype: torch.dtype, clip_norm: float | None) -> None:
    """A NaN/inf anywhere is a bad step; finite gradients whose 2-norm overflows the dtype (the fused norm says
    inf) are not. Clipping or not, the guard takes the same decision."""
    model = nn.Sequential(nn.Linear(20, 15), nn.Linear(15, 4)).to(dtype)
    optimizer = torch.optim.SGD(model.parameters())
    trainer = Stub(strategy=Stub(root_device=torch.device("cpu")), global_step=0, is_global_zero=True)

    def bad_step(fill: float, bad: float | None = None, at: int = 0) -> bool:
        guard = NonFiniteGuard("skip", max_skips=10, clip_norm=clip_norm)
        for p in model.parameters():
            p.grad = torch.full_like(p, fill)
        if bad is not None:
            list(model.parameters())[at].grad.view(-1)[3] = bad
        guard.on_before_backward(trainer, model, torch.tensor(1.0))  # type: ignore[arg-type]
        guard.on_before_optimizer_step(trainer, model, optimizer)  # type: ignore[arg-type]
        return guard.skipped_steps == [0]

    assert not bad_step(2.0)
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert bad_step(1.0, bad, 0) and bad_step(1.0, bad, 3)
    assert not bad_step(torch.finfo(dtype).max / 2)


def test_guard_votes_once_per_finite_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """One all-reduce (and one host read) per step for the loss and the gradients together; the exact per-element
    vote only follows a non-finite norm."""
    votes: list[list[float]] = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None: votes.append(t.tolist()))
    model = nn.Linear(2, 2)
    guard = NonFiniteGuard("skip", max_skips=5)
    guard_step(guard, model, 0, 1.0, 0.5)
    assert votes == [[0.0, 0.0, -1.0]]  # loss, norm's finiteness, no norm to carry (the guard does not clip here)
    guard_step(guard, model, 1, 1.0, float("nan"))
    assert votes[1:] == [[0.0, 1.0, -1.0], [1.0]] and guard.skipped_steps == [1]


def test_guard_drops_the_update_skips_then_stops() -> None:
    model = nn.Linear(2, 2)
    records: list[dict] = []
    guard = NonFiniteGuard("skip", max_skips=1, record=lambda kind, **f: records.append({"kind": kind, **f}))
    assert not guard_step(guard, model, 0, 1.0, 0.5).should_stop
    assert all(p.grad is not None for p in model.parameters())  # a finite step is left alone
    assert not guard_step(guard, model, 1, 1.0, float("nan")).should_stop
    assert all(p.grad is None for p in model.parameters())  # no gradient: the optimizer skips the parameter
    assert guard.skipped_steps == [1]
    assert guard_step(guard, model, 2, float("inf"), 0.5).should_stop
    assert guard.stopped_at == 2 and "non-finite loss at step 2" in str(guard.stop_reason)
    assert [(r["step"], r["action"], r["what"]) for r in records] == [
        (1, "skipped", "gradients"),
        (2, "stopped", "loss"),
    ]
    before = [p.clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert optimizer.state == {}  # not even Adam's step count moved


class EnabledScaler:
    def is_enabled(self) -> bool:
        return True


def test_fp16_overflows_are_left_to_the_loss_scaler_until_they_persist() -> None:
    """fp16's loss scaler overflows by design while it searches its scale and skips those updates itself: not a
    fault, the gradients are left to it. A run of MAX_SCALER_OVERFLOWS in a row is one; a non-finite loss always is."""
    model = nn.Linear(2, 2)
    guard = NonFiniteGuard("stop", max_skips=0)

    def step(n: int, loss: float, grad: float) -> Stub:
        trainer = Stub(
            strategy=Stub(root_device=torch.device("cpu")),
            precision_plugin=Stub(scaler=EnabledScaler()),
            global_step=n,
            should_stop=False,
        )
        for p in model.parameters():
            p.grad = torch.full_like(p, grad)
        guard.on_before_backward(trainer, model, torch.tensor(loss))  # type: ignore[arg-type]
        guard.on_before_optimizer_step(trainer, model, None)  # type: ignore[arg-type]
        return trainer

    assert not step(0, 1.0, float("inf")).should_stop
    assert all(p.grad is not None for p in model.parameters())  # the scaler's own found_inf skips the update
    assert not step(1, 1.0, 0.5).should_stop  # a finite step ends the run of overflows
    for n in range(2, 2 + MAX_SCALER_OVERFLOWS - 1):
        assert not step(n, 1.0, float("inf")).should_stop
    assert guard.scaler_skipped_steps == [0, *range(2, 1 + MAX_SCALER_OVERFLOWS)] and guard.stopped_at is None
    assert step(1 + MAX_SCALER_OVERFLOWS, 1.0, float("inf")).should_stop  # the 30th in a row
    assert guard.stopped_at == 1 + MAX_SCALER_OVERFLOWS and all(p.grad is None for p in model.parameters())
    guard = NonFiniteGuard("stop", max_skips=0)
    assert step(0, float("nan"), 0.5).should_stop  # a non-finite loss is never the scaler's


def test_guard_clips_with_the_norm_it_checked_exactly_as_clip_grad_norm() -> None:
    """With ``clip_norm`` the guard clips (the Trainer does not): bitwise what torch's clip_grad_norm_ gives over the
    optimizer's parameters, and a non-finite step is dropped, not clipped."""
    torch.manual_seed(0)
    model, reference = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3)), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.ndim == 1]}, {"params": []}])
    optimizer.param_groups[1]["params"] = [p for p in model.parameters() if p.ndim > 1]
    reference_order = [p for p in reference.parameters() if p.ndim == 1] + [
        p for p in reference.parameters() if p.ndim > 1
    ]
    guard = NonFiniteGuard("skip", max_skips=5, clip_norm=0.5)
    trainer = Stub(
        strategy=Stub(root_device=torch.device("cpu")), global_step=1, is_global_zero=True, should_stop=False
    )
    for scale in (3.0, 0.01):  # clipped (norm above 0.5), then left as it is (norm below)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            p.grad = torch.randn_like(p) * scale
            q.grad = p.grad.clone()
        guard.on_before_backward(trainer, model, torch.tensor(1.0))  # type: ignore[arg-type]
        guard.on_before_optimizer_step(trainer, model, optimizer)  # type: ignore[arg-type]
        torch.nn.utils.clip_grad_norm_(reference_order, 0.5)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    assert float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])) < 0.5
    next(model.parameters()).grad[0, 0] = float("nan")
    guard.on_before_optimizer_step(trainer, model, optimizer)  # type: ignore[arg-type]
    assert all(p.grad is None for p in model.parameters()) and guard.skipped_steps == [1]


def test_fault_specs() -> None:
    assert parse_fault("sigkill@step=7,rank=1") == Fault("step", 7, rank=1)
    assert parse_fault("sigkill@save=6,attempt=1") == Fault("save", 6, attempt=1)
    assert parse_fault("enospc@save=6,rank=1") == Fault("save", 6, rank=1, kind="enospc")
    assert parse_fault("nan_grad@step=3") == Fault("step", 3, kind="nan_grad")
    assert parse_fault("hot_expert@step=2,layer=1") == Fault("step", 2, kind="hot_expert", layer=1)
    assert parse_fault("hot_expert@step=1,layer=1,experts=2") == Fault("step", 1, kind="hot_expert", layer=1, experts=2)
    bad_specs = ("sigterm@step=1", "sigkill@rank=1", "sigkill@step=1,save=2", "sigkill@step=x", "enospc@step=2")
    for bad in (*bad_specs, "raise@save=3", "hang@step=1,rank=-1", "sigkill@step=1,layer=0"):
        with pytest.raises(ValueError, match="DISTTRAIN_FAULT"):
            parse_fault(bad)


def test_faults_apply_to_their_attempt_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTTRAIN_FAULT", "sigkill@step=4; raise@step=2,rank=1,attempt=1")
    assert faults_from_env(0) == [Fault("step", 4)]
    assert faults_from_env(1) == [Fault("step", 2, rank=1, attempt=1, kind="raise")]
    assert faults_from_env(2) == []


def test_launcher_tells_an_agreed_stop_from_a_death(tmp_path: Path) -> None:
    """Exit 4 with the rank's stop marker is the agreed non-finite stop; exit 4 without it, or any other code, is a
    death, reported at once."""
    write_stop_marker(tmp_path, 1, "non-finite loss at step 4 (nan_policy=stop)")
    exits = {1: 4, 2: 4, 3: 1}  # rank 1 stops as agreed; rank 2 exits 4 without a marker; rank 3 fails
    procs = [subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"]) for code in exits.values()]
    for proc in procs:
        proc.wait()
    ranks = LocalRanks(procs=procs, agreed_stop=partial(agreed_stop, tmp_path))
    reported: list[tuple[int, int]] = []
    done = threading.Event()
    ranks.watch(lambda rank, code: (reported.append((rank, code)), done.set()), period_s=0.05)
    assert done.wait(30)
    assert reported == [(2, 4)] and ranks.stopped == [(1, 4)]  # the watch stops at the first death
    assert ranks.dead(wait_s=0) == [(2, 4), (3, 1)]
    retire_stop_markers(tmp_path)
    assert not agreed_stop(tmp_path, 1, 4)


def test_exit_descriptions() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(1) == "exit code 1"


def test_how_a_dying_process_ended_is_read_before_it_is_reaped() -> None:
    """A rank reads how rank 0 (not its own child) ended from its zombie; once reaped, nothing is known."""
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    killed.kill()
    assert exit_status_of_dead_process(killed.pid, wait_s=10) == -9
    assert exit_status_of_dead_process(exited.pid, wait_s=10) == 3
    assert exit_status_of_dead_process(os.getpid(), wait_s=0) is None  # alive
    killed.wait(), exited.wait()
    assert exit_status_of_dead_process(killed.pid, wait_s=0) is None  # reaped: the pid is gone


def test_a_dead_launcher_is_recorded_once_and_only_over_a_running_run(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"status": "running", "config": {"diagnostics": {"report": 0}}}))
    assert record_launcher_death(tmp_path, -9) == "rank 0 died (killed by SIGKILL)"
    manifest = json.loads((tmp_path / "run.json").read_text())
    assert (manifest["status"], manifest["failed_rank"], manifest["failure"]) == (
        "failed",
        0,
        "rank 0 died (killed by SIGKILL)",
    )
    assert json.loads((tmp_path / "failure.json").read_text())["error"] == "killed by SIGKILL"
    assert not wants_report(tmp_path)
    # Rank 0 recorded an end itself (a hang, an error), then its ranks saw it go: nothing is overwritten.
    assert record_launcher_death(tmp_path, 3) is None
    assert json.loads((tmp_path / "run.json").read_text())["failure"] == "rank 0 died (killed by SIGKILL)"
    assert describe_launcher_death(None) == "rank 0 died (its process ended without ending the job)"


def test_redaction_of_environment_credentials_and_credential_keys() -> None:
    secrets = secret_values({"WANDB_API_KEY": "k" * 12, "HF_TOKEN": "hf_abcdefgh", "DEBUG": "1", "PATH": "/usr/bin"})
    assert secrets == {"k" * 12: "WANDB_API_KEY", "hf_abcdefgh": "HF_TOKEN"}
    config = {"model": {"note": "uses " + "k" * 12, "password": "hunter2", "layers": 2}, "cmd": ["+x.api_key=abc"]}
    assert redact(config, secrets) == {
        "model": {"note": "uses <redacted $WANDB_API_KEY>", "password": "<redacted>", "layers": 2},
        "cmd": ["+x.api_key=<redacted>"],
    }
    # Whole words only: token counts and tokenizers are not credentials (resume re-reads these overrides).
    harmless = ["data.num_train_tokens=65536", "trainer.keep_last_n=2", "+model.tokenizer=bpe"]
    assert redact(harmless, secrets) == harmless


def test_hot_expert_fault_sends_every_token_of_its_layer_to_expert_0_from_its_step() -> None:
    from disttrain.models import build_model
    from disttrain.models.moe import moe_layers
    from disttrain.reliability.faults import FaultInjection
    from tests.conftest import model_preset

    cfg = model_preset("moe-micro")
    model = build_model(cfg, seed=0)
    injection = FaultInjection([parse_fault("hot_expert@step=2,layer=1")])
    injection.rank = 0
    injection.on_train_start(None, model)  # type: ignore[arg-type]
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    first, second = moe_layers(model)
    for step, hot in ((1, False), (2, True)):
        injection.step = step
        model(tokens)
        assert (second.take_counts()[0][0] == 2 * cfg.seq_len) is hot  # every token's top-2 holds expert 0
        assert first.take_counts()[0][0] < 2 * cfg.seq_len  # the other layer routes as trained


def test_the_reporter_of_rank_0s_death_starts_without_vfork_and_once_more_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dying rank's other threads unwind while it starts the reporter: vfork's shared memory once gave exec a bad
    address (EFAULT in CI). The reporter starts by fork, and a failed start is tried again before it is reported."""
    from disttrain.job import launcher_death

    calls: list[list[str]] = []

    def popen(command: list[str], **kwargs: object) -> None:
        calls.append(command)
        assert subprocess._USE_VFORK is False  # type: ignore[attr-defined]
        if len(calls) == 1:
            raise OSError(14, "Bad address")

    monkeypatch.setattr(subprocess, "_USE_VFORK", True, raising=False)
    monkeypatch.setattr(launcher_death.subprocess, "Popen", popen)
    monkeypatch.setattr(launcher_death, "exit_status_of_dead_process", lambda pid: -9)
    launcher_death.report_launcher_death(tmp_path, 12345)
    assert len(calls) == 2 and calls[1][-2:] == [str(tmp_path), "-9"]
    assert "could not record" not in capsys.readouterr().err
    launcher_death.report_launcher_death(tmp_path, 12345)  # another rank: the claim is taken, nothing started
    assert len(calls) == 2

    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setattr(launcher_death.subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(OSError(14, "x")))
    launcher_death.report_launcher_death(other, 12345)
    assert "rank 0 died (killed by SIGKILL); could not record it" in capsys.readouterr().err
