"""Checkpoint on SLURM's warning signal, requeue, and resume in the same run dir.

SLURM signals every task of the job ``signal_delay_s`` before its time limit (``--signal=USR2@<s>``, written by
``hydra/launcher=slurm``); a preemption or ``scancel --signal=USR2`` looks the same. The handler only sets a flag:
saving inside a signal handler would start a collective at a different point of each rank's step. The flag
rides in the non-finite guard's vote (one all-reduce per optimizer step that runs anyway; a collective of its
own would be a second host read per step, a device sync on a GPU); before the first vote, or where a strategy's
engine skips the guard's hook, a collective of its own decides. One flagged rank is enough: at the end of that
optimizer step the ranks save ``step<N>.ckpt`` together through the run's ``StepCheckpoint`` and leave ``fit`` by
raising ``Preempted`` as the next batch starts (once this step's metrics are logged). ``slurm_attempt`` (around
training in ``run.py``) then requeues the job from rank 0 and waits for SLURM to end this attempt. The next
attempt runs the same Hydra job in the same run dir with ``SLURM_RESTART_COUNT`` > 0, which ``prepare`` treats as
a restart: it resumes from that dir's newest complete checkpoint. Lightning's own SLURM auto-requeue is switched
off (``SLURMEnvironment(auto_requeue=False)`` in ``build.py``): it saves from inside the signal handler.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import lightning.pytorch as pl

from disttrain.checkpoint.files import checkpoint_name
from disttrain.checkpoint.step import StepCheckpoint
from disttrain.launch.env import say
from disttrain.launch.exit_codes import FAILED, RunStopped
from disttrain.launch.slurm import SlurmTask, current_task, max_requeues, record_attempt, rendezvous_env, requeue

PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)  # submitit's default is USR2; Lightning users set USR1
REQUEUE_WAIT_S = 300.0  # SLURM ends a requeued attempt within KillWait (default 30 s) of the requeue


class Preempted(Exception):
    """Raised out of ``Trainer.fit`` after the preemption checkpoint of ``step`` is on disk (None: no step yet)."""

    def __init__(self, step: int, checkpoint: Path | None, signal_name: str) -> None:
        self.step = step
        self.checkpoint = checkpoint
        self.signal_name = signal_name
        super().__init__(f"{signal_name} at step {step}")


class CheckpointOnSignal(pl.Callback):
    """Every rank: flag the warning signal, and at the next optimizer step boundary save and stop together.

    Install it in ``NonFiniteGuard.riders`` too, so the flag rides in the guard's vote (see the module doc)."""

    def __init__(self, checkpoints: StepCheckpoint, signals: tuple[signal.Signals, ...] = PREEMPT_SIGNALS) -> None:
        self.checkpoints = checkpoints
        self.signals = signals
        self.received: int | None = None  # this rank's signal
        self.votes = 0
        self.voted: int | None = None  # the signal the vote agreed on (the highest number, if ranks got different ones)
        self.last_step = -1
        self.pending: Preempted | None = None
        self._previous: dict[int, object] = {}

    def flag(self, trainer: pl.Trainer) -> float:
        """This rank's part of the guard's vote: the signal's number, or 0."""
        return float(self.received or 0)

    def agreed(self, trainer: pl.Trainer, highest: float) -> None:
        self.votes += 1
        if highest > 0 and self.voted is None:
            self.voted = int(highest)

    def _flag(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Replaces submitit's handler, which would requeue at once without a training checkpoint.
        self._previous = {s: signal.signal(s, self._flag) for s in self.signals}

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        step = trainer.global_step
        if step == self.last_step or self.pending is not None:  # decide once per optimizer step
            return
        self.last_step = step
        # The signal reaches ranks at different moments, and all must stop together: the guard's vote decides once
        # it has run (every rank has seen as many votes at any batch end); until then a collective of our own.
        if self.votes:
            stop = self.voted is not None
        else:
            stop = trainer.strategy.reduce_boolean_decision(self.received is not None, all=False)
        if not stop:
            return
        received = self.received or self.voted
        name = signal.Signals(received).name if received is not None else "signal (on another rank)"
        skip = step == 0 or (self.checkpoints.skip_save is not None and self.checkpoints.skip_save())
        if self.checkpoints.last_saved_step != step and not skip:
            self.checkpoints.last_saved_step = step
            self.checkpoints.save(trainer, step)
        saved = step > 0 and self.checkpoints.last_saved_step == step
        # Stop at the next batch's start: Lightning logs this step's metrics after on_train_batch_end hooks.
        self.pending = Preempted(step, self.checkpoints.ckpt_dir / checkpoint_name(step) if saved else None, name)

    def on_train_batch_start(self, *args: object) -> None:
        if self.pending is not None:
            raise self.pending


def _exit_quietly(signum: int, frame: FrameType | None) -> None:
    os._exit(0)  # the requeue ended this attempt; the next one continues in the same run dir


def finish_preempted(preempted: Preempted, task: SlurmTask, run_dir: Path, rank_zero: bool) -> None:
    """Requeue the job (rank 0) and wait for SLURM to end this attempt; raise if it may not or does not."""
    limit = max_requeues()
    where = f"checkpoint {preempted.checkpoint}" if preempted.checkpoint else "no checkpoint (before step 1)"
    if task.restart_count >= limit:
        if rank_zero:
            record_attempt(
                run_dir, task, "preempted", step=preempted.step, signal=preempted.signal_name, requeued=False
            )
        raise RunStopped(
            FAILED,
            f"disttrain: {preempted.signal_name} at step {preempted.step} ({where}); not requeued: this job already "
            f"requeued {task.restart_count} time(s) (hydra.launcher.max_num_timeout={limit}). "
            f"Continue with: python -m train resume={run_dir}",
        )
    signal.signal(signal.SIGTERM, _exit_quietly)
    if rank_zero:
        record_attempt(
            run_dir, task, "preempted", step=preempted.step, signal=preempted.signal_name, requeued=True,
            checkpoint=str(preempted.checkpoint) if preempted.checkpoint else None,
        )  # fmt: skip
        say(f"disttrain: {preempted.signal_name} at step {preempted.step}: saved {where}; requeueing {task.label}")
        requeue(task)
    time.sleep(REQUEUE_WAIT_S)
    say(f"disttrain: requeued, but SLURM did not end this attempt within {REQUEUE_WAIT_S:.0f} s", file=sys.stderr)
    raise RunStopped(FAILED)


def keep_previous_metrics(run_dir: Path, attempt: int) -> None:
    """Keep the earlier attempt's metrics.csv as metrics_attempt<k>.csv: the CSV logger starts a new file."""
    metrics = run_dir / "metrics" / "metrics.csv"
    if attempt > 0 and metrics.is_file():
        metrics.rename(metrics.with_name(f"metrics_attempt{attempt - 1}.csv"))


@contextlib.contextmanager
def slurm_attempt(
    run_dir: Path, rank_zero: bool, resumed_from: Path | None, world: dict[str, int] | None = None
) -> Iterator[SlurmTask | None]:
    """Around training: under SLURM set the rendezvous, record the attempt, and requeue on ``Preempted``.

    ``world`` (world size, global batch, accumulation) goes into the attempt's start record: a requeued job may
    find another number of nodes and train on it (job/prepare.py, fit_elastic_world)."""
    task = current_task()
    if task is None:
        yield None
        return
    os.environ.update(rendezvous_env(task))
    if rank_zero:
        resumed = str(resumed_from) if resumed_from else None
        record_attempt(run_dir, task, "start", resumed_from=resumed, **(world or {}))
    try:
        yield task
    except Preempted as preempted:
        finish_preempted(preempted, task, run_dir, rank_zero)
    except BaseException as err:
        if rank_zero:
            record_attempt(run_dir, task, "failed", error=f"{type(err).__name__}: {err}")
        raise
    if rank_zero:
        record_attempt(run_dir, task, "end")
