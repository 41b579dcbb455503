"""Every rank's random-number-generator state, saved in each checkpoint and restored on resume.

Lightning saves model, optimizer, scheduler and loop state but no RNG state, so dropout masks after a resume
would differ from an uninterrupted run's. Each checkpoint gets ``rng_states``: one entry per global rank
(all-gathered, because only rank 0 writes the non-tensor part of a checkpoint under DDP and FSDP alike).
The states are plain tensors, ints and lists, so checkpoints still load with ``torch.load(weights_only=True)``.

A resume on another world size re-seeds instead (``RankRngState``).

The restore happens at the first training batch after a resume, not when the checkpoint is read: between
reading and the first step Lightning builds the dataloader iterator, which draws from the global generator,
while the uninterrupted run drew nothing between its save and its next step.
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from disttrain.launch.env import say_once

CHECKPOINT_KEY = "rng_states"


def capture() -> dict[str, Any]:
    """This process's python, numpy, torch CPU and CUDA generator states, as weights_only-loadable values."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # legacy=True always returns the MT19937 tuple
    name, keys, pos, has_gauss, cached = np_state
    return {
        "python": [version, list(internal), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else [],
    }


def restore(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_states(trainer: pl.Trainer) -> list[dict[str, Any]]:
    """Every rank's ``capture()``, indexed by global rank (a collective: every rank must call it)."""
    mine = capture()
    if trainer.world_size == 1 or not torch.distributed.is_initialized():
        return [mine]
    gathered: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(gathered, mine)
    return gathered


def rank_seed(seed: int, step: int, rank: int) -> int:
    """A seed for ``rank``'s generators from ``step`` on, the same on every machine (no salted ``hash``)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**32  # numpy takes 32-bit seeds


def reseed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


class RankRngState(pl.Callback):
    """Adds every rank's RNG state to each checkpoint and puts this rank's back at the first step of a resume.

    Under another world size the saved states cannot map onto the new ranks (rank 3 of 4 never existed in a run of
    2, and a rank's stream position depends on its share of the batch), so every rank is re-seeded from
    ``(seed, step, rank)`` instead: the continuation is deterministic (the same resume twice draws the same dropout
    masks), though not the draws the uninterrupted run made. The data order does not depend on these generators:
    the sampler's position is global (``data/datamodule.py``).
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.pending: dict[str, Any] | None = None
        self.pending_seed: int | None = None

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_KEY] = gather_states(trainer)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        states = checkpoint.get(CHECKPOINT_KEY)
        if not states:
            return  # a checkpoint from before RNG states were saved: resume as well as it can
        if len(states) != trainer.world_size:
            say_once(
                f"disttrain: the checkpoint holds RNG states of {len(states)} ranks but this run has "
                f"{trainer.world_size}: each rank's random generators are re-seeded from (trainer.seed, step, rank); "
                "random draws (dropout) continue deterministically but differ from an uninterrupted run's",
                file=sys.stderr,
            )
            self.pending_seed = rank_seed(self.seed, int(checkpoint.get("global_step", 0)), trainer.global_rank)
            return
        self.pending = states[trainer.global_rank]

    def on_train_batch_start(self, *args: object) -> None:
        if self.pending is not None:
            restore(self.pending)
            self.pending = None
        if self.pending_seed is not None:
            reseed(self.pending_seed)
            self.pending_seed = None
