"""Training progress on the console from global rank 0: a live Rich bar on a terminal, plain lines elsewhere.

On a terminal a person watches the run, so one bar redrawn in place (step, loss, tokens/s, ETA; as Lightning's
``RichProgressBar``) says more than a scroll of lines. In a SLURM log, a CI log or a pipe a redrawn bar is a
mess of control codes, so there the run prints about ten plain lines instead.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

import lightning.pytorch as pl
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from disttrain.launch.env import say
from disttrain.training.callbacks import Throughput

MAX_OWN_METRICS = 3  # a module's own metrics on one progress line


def progress_fields(trainer: pl.Trainer, throughput: Throughput, lr: bool = True) -> list[str]:
    """The latest loss, validation loss, learning rate (``lr``) and tokens/s, as the lines and the bar show them."""
    metrics = trainer.callback_metrics
    parts = []
    if "train/loss" in metrics or "val/loss" in metrics:
        if "train/loss" in metrics:
            parts.append(f"loss {float(metrics['train/loss']):.4f}")
        if "val/loss" in metrics:
            parts.append(f"val {float(metrics['val/loss']):.4f}")
    else:  # a LightningModule's own: what it logs to the progress bar, else its losses
        losses = {k: v for k, v in metrics.items() if "loss" in k}
        shown = {**losses, **{k: v for k, v in trainer.progress_bar_metrics.items() if k != "v_num"}}
        parts += [f"{name} {float(value):.4g}" for name, value in list(shown.items())[:MAX_OWN_METRICS]]
    if lr and trainer.optimizers:
        parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.2e}")
    if throughput.units_per_s:
        rate = throughput.units_per_s
        parts.append(f"{rate:,.0f} tok/s" if throughput.unit == "token" else f"{rate:,.1f} samples/s")
    return parts


class ProgressPrinter(pl.Callback):
    """About ten one-line progress reports per run from rank 0 (a progress bar is noise in cluster logs)."""

    def __init__(self, every_n_steps: int, throughput: Throughput) -> None:
        self.every_n_steps = max(1, every_n_steps)
        self.throughput = throughput
        self.last_printed = -1

    @staticmethod
    def interval(max_steps: int, log_every_n_steps: int) -> int:
        """A multiple of the logging interval (so the loss shown is fresh) near a tenth of the run."""
        return log_every_n_steps * max(1, round(max_steps / 10 / log_every_n_steps))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        step = trainer.global_step
        due = step % self.every_n_steps == 0 or step >= trainer.max_steps
        if not trainer.is_global_zero or step == self.last_printed or not due:
            return
        self.last_printed = step
        say("  ".join([f"step {step}/{trainer.max_steps}", *progress_fields(trainer, self.throughput)]))


class CursorKeepingConsole(Console):
    """A Rich console that never hides the terminal's cursor.

    Rich hides it while a bar is live and shows it again when the bar stops; a job that ends with ``os._exit``
    (a rank died, the launcher stops the job at once) never gets there and would leave the user's shell without
    a cursor."""

    def show_cursor(self, show: bool = True) -> bool:
        return False


class RichProgress(pl.Callback):
    """A live bar on rank 0's terminal: step/max_steps, the latest loss and validation loss, tokens/s, ETA.

    It fits an 80-column terminal (the bar shrinks first; the learning rate is left to the logger's metrics).
    The run's own lines printed while it is drawn (``say``) appear above it: Rich redirects stdout/stderr while it
    is live. Redrawn at most ``refresh_per_s`` times a second, from the training loop's own thread (no refresh
    thread beside the step being timed). The final state stays on screen when training ends.
    """

    def __init__(self, throughput: Throughput, console: Console | None = None, refresh_per_s: float = 4.0) -> None:
        self.throughput = throughput
        self.console = console
        self.min_interval_s = 1.0 / refresh_per_s
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        self._last_refresh = 0.0

    def on_train_start(self, trainer: pl.Trainer, *args: object) -> None:
        if not trainer.is_global_zero:
            return
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=None),
            TextColumn("{task.percentage:>3.0f}%"),
            TextColumn("{task.fields[metrics]}"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console or CursorKeepingConsole(),
            auto_refresh=False,
            redirect_stdout=True,
            redirect_stderr=True,
        )
        self.progress.start()
        # A resumed run starts at its checkpoint's step: the bar starts there too.
        self.task = self.progress.add_task(
            self._description(trainer), total=trainer.max_steps, completed=trainer.global_step, metrics=""
        )
        self.progress.refresh()

    @staticmethod
    def _description(trainer: pl.Trainer, doing: str = "") -> str:
        return f"step {trainer.global_step}/{trainer.max_steps}{doing}"

    def _update(self, trainer: pl.Trainer, doing: str = "", force: bool = False) -> None:
        if self.progress is None or self.task is None:
            return
        metrics = "  ".join(progress_fields(trainer, self.throughput, lr=False))
        self.progress.update(
            self.task, completed=trainer.global_step, description=self._description(trainer, doing), metrics=metrics
        )
        now = time.monotonic()
        if force or now - self._last_refresh >= self.min_interval_s or trainer.global_step >= trainer.max_steps:
            self._last_refresh = now
            self.progress.refresh()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self._update(trainer)

    def on_validation_start(self, trainer: pl.Trainer, *args: object) -> None:
        if not trainer.sanity_checking:
            self._update(trainer, " (validating)", force=True)

    def on_validation_end(self, trainer: pl.Trainer, *args: object) -> None:
        if not trainer.sanity_checking:
            self._update(trainer, force=True)

    def _stop(self) -> None:
        if self.progress is not None:
            self.progress.refresh()
            self.progress.stop()  # gives stdout/stderr back: what follows (summary, a traceback) prints as usual
            self.progress = None

    def on_train_end(self, trainer: pl.Trainer, *args: object) -> None:
        self._update(trainer, force=True)
        self._stop()

    def on_exception(self, *args: object) -> None:
        self._stop()


def draws_a_bar(stream: TextIO) -> bool:
    """A live bar only where a person watches: ``stream`` is a terminal that can redraw a line (not TERM=dumb)."""
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # a closed or stream-like object without a file descriptor
        return False
    return terminal and os.environ.get("TERM", "").lower() not in ("dumb", "unknown")


def build_progress(
    max_steps: int, log_every_n_steps: int, throughput: Throughput, stream: TextIO | None = None
) -> pl.Callback:
    """The progress callback for where this process's stdout goes (``stream``; stdout when not given)."""
    stream = sys.stdout if stream is None else stream
    if draws_a_bar(stream):
        console = CursorKeepingConsole(file=None if stream is sys.stdout else stream, force_terminal=True)
        return RichProgress(throughput, console)
    return ProgressPrinter(ProgressPrinter.interval(max_steps, log_every_n_steps), throughput)
