"""The non-finite guard's vote carried in DDP's own gradient all-reduce: no collective of the guard's a step.

Under DDP every rank holds the same averaged gradients once backward ends (the all-reduce leaves every rank the
same bits), so the gradients' norm and its finiteness need no vote: each rank reaches the same verdict alone.
What only one rank can know is its own loss and its riders' flags (a SIGTERM, SLURM's warning signal); those are
known before backward all-reduces the gradients, so they travel in it: a few values appended to the first
gradient bucket (DDP caps it at 1 MB, so the copy is small) and summed with it. On a 2-rank CPU run a vote of
its own cost a fifth of the step (benchmarks/RESULTS.md); appended, it costs a copy of the first bucket.

A sum is not the vote's maximum, so each rank writes into a slot of its own: the loss flag is 0 or 1 (a sum > 0 is
"some rank"), each rider's flag goes into ``rank * riders + i`` and the slots' maximum is taken after the sum
(every other rank adds 0 there, exactly). The slots need exact small integers, so the vote rides only in float32
or float64 buckets; a bf16 model's buckets, torch's compression hooks, PowerSGD and 1-bit Adam keep the guard's own
collective. Whether a step's verdict came in the gradients is the same on every rank (the same buckets run on all
of them, or DDP hangs), so the ranks never split between the two ways.
"""

# No ``from __future__ import annotations``: DDP inspects a comm hook's signature and refuses string annotations.

from collections.abc import Callable

import torch
import torch.distributed as dist

CARRIED_DTYPES = (torch.float32, torch.float64)
CarriedFlags = Callable[[int, int, torch.device, torch.dtype], torch.Tensor]


class GradientVote:
    """DDP's all-reduce as a comm hook, with the guard's flags appended to the first bucket.

    ``flags(world, rank, device, dtype)`` (set by the guard) gives this rank's part; ``take()`` gives the summed
    flags of the latest backward since the last ``take``, or None where none carried them (then the guard votes).
    """

    def __init__(self) -> None:
        self.flags: CarriedFlags | None = None
        self._summed: torch.Tensor | None = None

    def take(self) -> torch.Tensor | None:
        summed, self._summed = self._summed, None
        return summed

    def hook(self, process_group: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """torch's ``allreduce_hook`` (average: divide, then sum), the flags appended to bucket 0."""
        group = process_group if process_group is not None else dist.group.WORLD
        world = dist.get_world_size(group)  # type: ignore[arg-type]
        buffer = bucket.buffer()
        buffer.div_(world)
        if self.flags is None or bucket.index() != 0 or buffer.dtype not in CARRIED_DTYPES:
            plain = dist.all_reduce(buffer, group=group, async_op=True).get_future()  # type: ignore[arg-type, union-attr]
            return plain.then(lambda fut: fut.value()[0])
        rank = dist.get_rank(group)  # type: ignore[arg-type]
        size = buffer.numel()
        joined = torch.cat([buffer, self.flags(world, rank, buffer.device, buffer.dtype)])
        summed = dist.all_reduce(joined, group=group, async_op=True).get_future()  # type: ignore[arg-type, union-attr]

        def split(fut: torch.futures.Future) -> torch.Tensor:
            out = fut.value()[0]
            self._summed = out[size:]
            return buffer.copy_(out[:size])

        return summed.then(split)


def host_flags_to(device: torch.device, flags: list[float]) -> torch.Tensor:
    """Host values as one tensor on ``device``. To a GPU through pinned memory: a copy from pageable memory waits for
    every kernel queued before it (a device sync per step, which the deferred verdict exists to avoid)."""
    values = torch.tensor(flags, dtype=torch.float32)
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def slots_of(
    world: int, rank: int, loss_bad: torch.Tensor, riders: list[float], device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """This rank's part: the loss flag (0/1), then ``world x len(riders)`` slots, its own riders in its row."""
    values = [0.0] * (1 + world * len(riders))
    values[1 + rank * len(riders) : 1 + (rank + 1) * len(riders)] = riders
    flags = host_flags_to(device, values).to(dtype)
    flags[0] = loss_bad.to(device=device, dtype=dtype)
    return flags


def verdict_of(summed: torch.Tensor, riders: int, norm_bad: torch.Tensor, norm_value: torch.Tensor) -> torch.Tensor:
    """The carried flags as the guard's own vote gives them: [loss, norm not finite, norm, *riders' maxima]."""
    highest = summed[1:].reshape(-1, riders).amax(dim=0) if riders else summed[1:]
    device = summed.device
    local = [(summed[0] > 0).to(torch.float32), norm_bad.to(device, torch.float32), norm_value.to(device).float()]
    return torch.cat([torch.stack(local), highest.to(torch.float32)])
