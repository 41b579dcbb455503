"""A LightningModule's loaders in one sample order for every world size: what one process sees with micro-batch
``n x m`` is, step by step, what ``n`` ranks of micro-batch ``m`` see together.

Lightning's own DistributedSampler shuffles every training loader with its own seed (even one the user made
sequential) and a single process keeps the user's sampler, so the two runs train on other batches and no layout can
be compared with one process. Here a loader with a plain sampler (sequential, or ``shuffle=True``'s random one) gets
``EpochShardedSampler``: the user's order (in order, or a permutation seeded by ``trainer.seed`` and the epoch) of
which rank ``r`` of ``n`` takes items ``r, r + n, ...``. It is a DistributedSampler, so Lightning leaves it in place;
a loader with a sampler of the user's own, or over an iterable dataset, is left to Lightning as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler


class EpochShardedSampler(DistributedSampler):
    """One epoch of the world-size-invariant order; the tail that does not divide by the ranks is dropped.

    ``resume_at(sample)``: the next iteration continues the stream at that global sample (a resumed run's
    ``global_step x global batch``), in the epoch it falls in, so a resume trains on the batches the run would have."""

    def __init__(self, dataset: Any, num_replicas: int, rank: int, shuffle: bool, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.total_size = len(dataset) // num_replicas * num_replicas
        self.num_samples = self.total_size // num_replicas
        self._resume: tuple[int, int] | None = None  # (epoch, offset) of the next iteration only

    def resume_at(self, sample: int) -> None:
        self._resume = divmod(sample, self.total_size) if sample > 0 else None

    def __iter__(self) -> Iterator[int]:
        epoch, offset = self._resume if self._resume is not None else (self.epoch, 0)
        self._resume = None
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(len(self.dataset), generator=generator)[: self.total_size]  # type: ignore[arg-type]
        else:
            order = torch.arange(self.total_size)
        return iter(order[offset + self.rank : self.total_size : self.num_replicas].tolist())


def sharded(loader: Any, rank: int, world: int, seed: int) -> Any:
    """``loader`` with its plain sampler replaced (see the module docstring); anything else as it is."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    if type(loader.sampler) not in (SequentialSampler, RandomSampler):
        return loader
    from lightning.pytorch.utilities.data import _update_dataloader

    shuffle = isinstance(loader.sampler, RandomSampler)
    return _update_dataloader(loader, EpochShardedSampler(loader.dataset, world, rank, shuffle, seed))


def shard_user_loaders(datamodule: pl.LightningDataModule, rank: int, world: int, seed: int, global_batch: int) -> None:
    """Wrap the instance's train and validation loader hooks so every loader they return is ``sharded``; a resumed
    run's training loader continues at ``global_step x global_batch`` (Lightning would restart the epoch at its first
    batch: a plain loader cannot be fast-forwarded)."""
    for hook in ("train_dataloader", "val_dataloader"):
        if getattr(type(datamodule), hook, None) is getattr(pl.LightningDataModule, hook):
            continue  # not defined by the user: wrapping it would make Lightning call the base's "must implement"
        own: Callable[[], Any] = getattr(datamodule, hook)

        def loaders(own: Callable[[], Any] = own, train: bool = hook == "train_dataloader") -> Any:
            made = own()
            if isinstance(made, list | tuple):
                return type(made)(sharded(loader, rank, world, seed) for loader in made)
            if isinstance(made, dict):
                return {key: sharded(loader, rank, world, seed) for key, loader in made.items()}
            made = sharded(made, rank, world, seed)
            trainer = getattr(datamodule, "trainer", None)
            sampler = getattr(made, "sampler", None)
            if train and trainer is not None and isinstance(sampler, EpochShardedSampler):
                sampler.resume_at(trainer.global_step * global_batch)
            return made

        setattr(datamodule, hook, loaders)
