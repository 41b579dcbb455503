"""Sample order that does not depend on the world size and can restart at any optimizer step.

The global stream is the concatenation of per-epoch permutations (epoch ``e`` shuffled with ``seed + e``);
rank ``r`` of ``n`` takes stream items ``r, r + n, r + 2n, ...`` exactly like DistributedSampler does within
an epoch. So the union of the ranks' micro-batches at any step is the same set of samples a single process
sees with an ``n`` times larger micro-batch — the basis of the loss-parity tests — and a run resumed at
step ``s`` restarts the stream at ``s * global_batch_size`` with no batch skipped or repeated.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableShardedSampler(Sampler[int]):
    """Endless, seeded, rank-sharded sample stream starting at ``start_sample`` (a global position)."""

    def __init__(self, dataset_len: int, num_replicas: int, rank: int, seed: int, start_sample: int = 0) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside [0, {num_replicas})")
        # Drop the tail so every rank gets the same number of samples per epoch (DistributedSampler drop_last).
        self.samples_per_epoch = dataset_len // num_replicas * num_replicas
        if self.samples_per_epoch == 0:
            raise ValueError(f"{dataset_len} samples cannot be shared by {num_replicas} ranks")
        if start_sample % num_replicas:
            raise ValueError(f"start_sample {start_sample} is not a multiple of the {num_replicas} ranks")
        self.dataset_len = dataset_len
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.start_sample = start_sample

    def epoch_permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_len, generator=generator)[: self.samples_per_epoch]

    def __iter__(self) -> Iterator[int]:
        epoch, offset = divmod(self.start_sample, self.samples_per_epoch)
        while True:
            order = self.epoch_permutation(epoch)
            yield from order[offset + self.rank :: self.num_replicas].tolist()
            epoch, offset = epoch + 1, 0


class ShardedEvalSampler(Sampler[int]):
    """Fixed, unshuffled evaluation order: rank ``r`` takes ``r, r + n, ...`` of an equal-length prefix."""

    def __init__(self, dataset_len: int, num_replicas: int, rank: int) -> None:
        self.indices = list(range(rank, dataset_len // num_replicas * num_replicas, num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
