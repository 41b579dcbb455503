"""Progress on the console: a live bar on a terminal, today's plain lines elsewhere, drawn by global rank 0 only."""

from __future__ import annotations

import io
import os
import re
import select
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from disttrain.training.callbacks import Throughput
from disttrain.training.progress import ProgressPrinter, RichProgress, build_progress

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def fake_trainer(step: int, max_steps: int = 20, global_zero: bool = True, val: float | None = None):
    """What the progress callbacks read of a Trainer: step, limit, rank, metrics and the optimizer's lr."""
    metrics = {"train/loss": torch.tensor(3.0 - step / 10)}
    if val is not None:
        metrics["val/loss"] = torch.tensor(val)
    optimizer = SimpleNamespace(param_groups=[{"lr": 3e-4}])
    return SimpleNamespace(
        global_step=step,
        max_steps=max_steps,
        is_global_zero=global_zero,
        callback_metrics=metrics,
        optimizers=[optimizer],
        sanity_checking=False,
    )


def throughput(tokens_per_s: float | None) -> Throughput:
    meter = Throughput(units_per_step=512, skip_steps=0)
    meter.units_per_s = tokens_per_s
    return meter


def frames_of(raw: str) -> list[str]:
    """The successive states of the bar, control codes removed."""
    return [frame for frame in (ANSI.sub("", part) for part in re.split(r"\r|\n", raw)) if frame.strip()]


def run_bar(global_zero: bool, start: int = 0) -> str:
    out = io.StringIO()
    bar = RichProgress(throughput(12345.6), Console(file=out, force_terminal=True, width=160), refresh_per_s=1e9)
    bar.on_train_start(fake_trainer(start, global_zero=global_zero))
    for step in range(start + 1, 21):
        bar.on_train_batch_end(fake_trainer(step, global_zero=global_zero, val=2.5 if step >= 10 else None))
        if step == 10:
            bar.on_validation_start(fake_trainer(step, global_zero=global_zero))
            bar.on_validation_end(fake_trainer(step, global_zero=global_zero, val=2.5))
    bar.on_train_end(fake_trainer(20, global_zero=global_zero, val=2.5))
    return out.getvalue()


def test_the_bar_redraws_in_place_with_step_loss_tokens_and_eta() -> None:
    raw = run_bar(global_zero=True)
    assert "\x1b[" in raw and "\r" in raw  # redrawn on a terminal, not printed line after line
    frames = frames_of(raw)
    first, last = frames[0], frames[-1]
    assert "step 0/20" in first and "0%" in first
    assert "step 20/20" in last and "100%" in last
    assert "loss 1.0000" in last and "val 2.5000" in last and "12,346 tok/s" in last and "lr" not in last
    assert "ETA" in last and re.search(r"\d:\d\d:\d\d", last)
    assert any("step 10/20 (validating)" in frame for frame in frames)
    assert any("step 15/20" in frame and "loss 1.5000" in frame for frame in frames)


def test_a_resumed_run_starts_the_bar_at_its_step() -> None:
    frames = frames_of(run_bar(global_zero=True, start=12))
    assert "step 12/20" in frames[0] and "60%" in frames[0]


def test_only_global_rank_zero_draws() -> None:
    assert run_bar(global_zero=False) == ""


def test_stdout_is_given_back_when_the_bar_stops() -> None:
    import sys

    before = sys.stdout
    bar = RichProgress(throughput(None), Console(file=io.StringIO(), force_terminal=True))
    bar.on_train_start(fake_trainer(0))
    assert sys.stdout is not before  # prints during training go above the bar
    bar.on_exception()
    assert sys.stdout is before


def test_plain_lines_when_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    progress = build_progress(max_steps=20, log_every_n_steps=5, throughput=throughput(12345.6), stream=io.StringIO())
    assert isinstance(progress, ProgressPrinter) and progress.every_n_steps == 5
    for step in range(1, 21):
        progress.on_train_batch_end(fake_trainer(step, val=2.5 if step >= 10 else None))
        progress.on_train_batch_end(fake_trainer(step, global_zero=False))
    assert capsys.readouterr().out.splitlines() == [
        "step 5/20  loss 2.5000  lr 3.00e-04  12,346 tok/s",
        "step 10/20  loss 2.0000  val 2.5000  lr 3.00e-04  12,346 tok/s",
        "step 15/20  loss 1.5000  val 2.5000  lr 3.00e-04  12,346 tok/s",
        "step 20/20  loss 1.0000  val 2.5000  lr 3.00e-04  12,346 tok/s",
    ]


def read_available(fd: int, quiet_s: float = 0.5) -> str:
    """Everything written to the terminal so far (a pty hands it over in pieces)."""
    chunks = []
    while select.select([fd], [], [], quiet_s)[0]:
        chunks.append(os.read(fd, 65536))
    return b"".join(chunks).decode()


def test_a_terminal_gets_the_bar_and_a_dumb_one_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    primary, secondary = os.openpty()
    with os.fdopen(secondary, "w") as terminal:
        monkeypatch.setenv("TERM", "xterm-256color")
        bar = build_progress(max_steps=20, log_every_n_steps=5, throughput=throughput(None), stream=terminal)
        assert isinstance(bar, RichProgress)
        bar.on_train_start(fake_trainer(0))
        bar.on_train_batch_end(fake_trainer(1))
        bar.on_train_end(fake_trainer(1))
        terminal.flush()
        drawn = read_available(primary)
        assert "step 1/20" in drawn and "\x1b[" in drawn
        assert "\x1b[?25l" not in drawn  # the cursor stays visible: a job ended by os._exit cannot leave it hidden
        monkeypatch.setenv("TERM", "dumb")
        assert isinstance(build_progress(20, 5, throughput(None), stream=terminal), ProgressPrinter)
    os.close(primary)


def test_the_bar_fits_an_80_column_terminal() -> None:
    out = io.StringIO()
    bar = RichProgress(throughput(123456.7), Console(file=out, force_terminal=True, width=80), refresh_per_s=1e9)
    bar.on_train_start(fake_trainer(0, max_steps=100000))
    bar.on_train_batch_end(fake_trainer(12, max_steps=100000, val=2.5))
    bar.on_train_end(fake_trainer(12, max_steps=100000, val=2.5))
    last = frames_of(out.getvalue())[-1]
    assert "…" not in last and len(last.rstrip()) <= 80
    assert "step 12/100000" in last and "loss 1.8000" in last and "123,457 tok/s" in last and "ETA" in last
