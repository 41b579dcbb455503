"""Room for a run's checkpoints, checked before any rank starts.

A disk that fills at the second checkpoint ends a run mid-write, on every rank, far from the config that caused it;
how much the checkpoints take is known before launch. One checkpoint holds at least every parameter and its
optimizer states once in fp32, however the ranks shard them (DDP's rank 0 writes one copy; FSDP, ZeRO and DCP one
shard per rank, the same bytes in all): a lower bound, as buffers, RNG and loop states come on top, so no run that
fits is refused. The run holds ``keep_last_n`` of them plus the one being written before the oldest is removed
(every one, without ``keep_last_n``). Only the checkpoints are counted: telemetry, logs and the report are small
beside them, and a shortfall there is left to the run's own handling of a full disk.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from disttrain.config.errors import ConfigError
from disttrain.config.schema import TrainerConfig
from disttrain.planner.shapes import ModelShape

FP32 = 4
GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class CheckpointSpace:
    each_bytes: int  # one checkpoint
    held: int  # at most on disk at once during the run
    free_bytes: int
    where: Path  # the nearest existing dir of the checkpoint dir: the filesystem it lands on

    @property
    def needed_bytes(self) -> int:
        return self.each_bytes * self.held

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.free_bytes


def checkpoint_bytes(shape: ModelShape) -> int:
    """One checkpoint's bytes: every parameter and its optimizer states, fp32."""
    return int(shape.num_parameters * FP32 * (1 + shape.optimizer_states))


def checkpoints_held(trainer: TrainerConfig) -> int:
    """The most checkpoints on disk at once: every step checkpoint and the final one, or ``keep_last_n`` of them
    and the one being written."""
    every = trainer.ckpt_every_n_steps
    if every <= 0:
        return 0
    written = math.ceil(trainer.max_steps / every)  # the final step is saved too, where it is not a multiple
    return written if trainer.keep_last_n is None else min(written, trainer.keep_last_n + 1)


def checkpoint_space(
    shape: ModelShape,
    trainer: TrainerConfig,
    ckpt_dir: Path,
    free_bytes: Callable[[Path], int] = lambda path: shutil.disk_usage(path).free,
) -> CheckpointSpace:
    where = next((p for p in (ckpt_dir, *ckpt_dir.parents) if p.is_dir()), ckpt_dir)
    return CheckpointSpace(checkpoint_bytes(shape), checkpoints_held(trainer), free_bytes(where), where)


def check_checkpoint_space(space: CheckpointSpace) -> None:
    """Refuse a run whose checkpoints cannot fit the free space, with the ``keep_last_n`` that would fit."""
    if space.fits:
        return
    fitting = space.free_bytes // space.each_bytes - 1  # keep_last_n=K holds K + 1 at once
    fix = f"set trainer.keep_last_n={fitting}" if fitting >= 1 else "free space there"
    raise ConfigError(
        "trainer.keep_last_n",
        f"{space.held} checkpoints of {size(space.each_bytes)} each ({size(space.needed_bytes)}) would not fit the "
        f"{size(space.free_bytes)} free at '{space.where}'",
        f"{fix}, raise trainer.ckpt_every_n_steps, or put hydra.run.dir on a disk with room",
    )


def size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"
