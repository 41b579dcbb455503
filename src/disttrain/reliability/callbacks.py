"""The callbacks that make a run survivable: atomic step checkpoints, RNG capture, the non-finite guard.

Strategy-neutral: they only use ``trainer.save_checkpoint``, ``torch.distributed`` collectives and the
parameters' gradients, so every strategy gets them (see docs/reliability.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl

from disttrain.checkpoint.rng import RankRngState
from disttrain.checkpoint.step import StepCheckpoint
from disttrain.config.schema import TrainerConfig
from disttrain.launch.env import process_role
from disttrain.reliability.faults import FaultInjection, faults_from_env
from disttrain.reliability.nan_guard import NonFiniteGuard
from disttrain.reliability.preemption import CheckpointOnSignal
from disttrain.reliability.sigterm import SigtermInVote


@dataclass
class Reliability:
    checkpoints: StepCheckpoint
    guard: NonFiniteGuard
    callbacks: list[pl.Callback]  # in the order the Trainer must run them
    # Under SLURM: the preemption checkpoint, to run after every other callback (the step it stops at has been seen
    # by all of them); its flag already rides in the guard's vote.
    preemption: CheckpointOnSignal | None = None


def build_reliability(
    t: TrainerConfig, ckpt_dir: Path, clip_norm: float | None = None, preemptible: bool = False
) -> Reliability:
    """``clip_norm``: the guard clips the gradients by this norm (the Trainer must then not clip them itself).
    ``preemptible``: the job's scheduler warns with a signal before it ends it (SLURM): checkpoint and stop then."""
    guard = NonFiniteGuard(t.nan_policy, t.max_nan_skips, clip_norm=clip_norm)
    sigterm = SigtermInVote()  # Lightning's per-batch SIGTERM broadcast, carried by the guard's vote instead
    guard.riders.append(sigterm)
    faults = faults_from_env(process_role().attempt)
    injector = FaultInjection(faults) if faults else None
    checkpoints = StepCheckpoint(
        ckpt_dir,
        t.ckpt_every_n_steps,
        keep_last_n=t.keep_last_n,
        # The step that stopped the run is not a good state to resume from; a verdict still pending is read first.
        skip_save=lambda: guard.settle() or guard.stopped,
        before_publish=injector.before_publish if injector is not None else None,
        before_write=injector.before_write if injector is not None else None,
    )
    # The injector runs after StepCheckpoint, so a kill "after step N" comes after step N's checkpoint.
    callbacks: list[pl.Callback] = [guard, sigterm, checkpoints, RankRngState(t.seed)]
    if injector is not None:
        callbacks.append(injector)
    preemption = None
    if preemptible:
        preemption = CheckpointOnSignal(checkpoints)
        guard.riders.append(preemption)  # the same on every rank of a job
    return Reliability(checkpoints, guard, callbacks, preemption)
