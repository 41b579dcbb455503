"""The non-finite guard's vote carried in DDP's gradient all-reduce (reliability/gradient_vote.py): two real gloo
ranks, a DDP model, the guard driven through its hooks with a stand-in Trainer. The guard's own collective is
made to fail, so a verdict that did not come in the gradients fails the test."""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from disttrain.reliability import nan_guard
from disttrain.reliability.gradient_vote import GradientVote, slots_of, verdict_of
from disttrain.reliability.nan_guard import NonFiniteGuard

WORLD = 2


class Rider:
    """A rider whose flag is fixed per rank (as SIGTERM's rank + 1 or a signal's number would be)."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.highest: list[float] = []

    def flag(self, trainer: object) -> float:
        return self.value

    def agreed(self, trainer: object, highest: float) -> None:
        self.highest.append(highest)


def model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    # Three layers of ~40 KB each under a 0.05 MB bucket cap: the flags ride in one bucket of several.
    return nn.Sequential(nn.Linear(100, 100), nn.Tanh(), nn.Linear(100, 100), nn.Tanh(), nn.Linear(100, 1)).to(dtype)


def one_step(rank: int, ddp: nn.Module, guard: NonFiniteGuard, bad_loss: bool) -> dict:
    torch.manual_seed(100 + rank)  # each rank its own batch
    x = torch.randn(8, 100, dtype=next(ddp.parameters()).dtype)
    loss = ddp(x).square().mean()
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), global_step=0,
                              global_rank=rank, should_stop=False)  # fmt: skip
    loss_seen = loss * float("nan") if bad_loss else loss  # the guard's flag: the gradients stay finite
    guard.on_before_backward(trainer, ddp, loss_seen)  # type: ignore[arg-type]
    loss.backward()
    grads = [p.grad.clone() for p in ddp.parameters()]
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    guard.on_before_optimizer_step(trainer, ddp, optimizer)  # type: ignore[arg-type]
    return {"grads": grads, "stopped": trainer.should_stop, "dropped": all(p.grad is None for p in ddp.parameters())}


def worker(rank: int, store: str, out: str, dtype: torch.dtype) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        builtin = DistributedDataParallel(model(dtype), bucket_cap_mb=0.05)
        reference = one_step(rank, builtin, NonFiniteGuard("stop", 0), bad_loss=False)  # the guard's own vote
        carried = DistributedDataParallel(model(dtype), bucket_cap_mb=0.05)
        guard = NonFiniteGuard("stop", 0)
        riders = [Rider(7.0 if rank == 0 else 0.0), Rider(float(rank + 1))]
        guard.riders += riders
        carrier = GradientVote()
        guard.carry_in(carrier)
        carried.register_comm_hook(None, carrier.hook)
        votes = []

        def no_vote(flags: list[torch.Tensor]) -> torch.Tensor:
            votes.append(len(flags))
            return torch.stack([f.reshape(()) for f in flags]).float()

        nan_guard.cast_vote = no_vote  # a verdict taken by the guard's own collective is counted, not cast
        result = one_step(rank, carried, guard, bad_loss=rank == 1)
        torch.save(
            {
                "reference": reference["grads"],
                **result,
                "own_votes": votes,
                "highest": [r.highest for r in riders],
            },
            f"{out}/rank{rank}.pt",
        )
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    # As the product's ranks end (launch/process_exit.py): tearing gloo down under the interpreter can deadlock with
    # a worker thread still releasing the last comm hook's Python callback (it waits for the GIL while the main
    # thread joins it in ~ProcessGroupGloo).
    os._exit(0)


def run(tmp_path: Path, dtype: torch.dtype) -> list[dict]:
    mp.spawn(worker, args=(str(tmp_path / "store"), str(tmp_path), dtype), nprocs=WORLD, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_one_ranks_bad_loss_and_each_ranks_flags_reach_every_rank_in_the_gradients(tmp_path: Path) -> None:
    ranks = run(tmp_path, torch.float32)
    for rank in ranks:
        assert rank["own_votes"] == [], "the verdict must come in the gradients, not in a vote of the guard's own"
        assert rank["highest"] == [[7.0], [2.0]]  # each rider's maximum over the ranks, on every rank
        # Rank 1's loss alone was non-finite: every rank stops and drops the step's gradients together.
        assert rank["stopped"] and rank["dropped"]
        # The gradients are DDP's own average (2 ranks: the sum of two values, the same bits however chunked).
        for got, want in zip(rank["grads"], rank["reference"], strict=True):
            assert torch.equal(got, want)


def test_a_bf16_model_keeps_the_guards_own_vote(tmp_path: Path) -> None:
    """bf16 holds integers exactly only to 256: the flags do not ride in its buckets, on any rank."""
    for rank in run(tmp_path, torch.bfloat16):
        assert rank["own_votes"] == [5]  # loss, norm finiteness, norm, two riders


def test_slots_sum_to_each_riders_maximum() -> None:
    parts = [
        slots_of(3, rank, torch.tensor(rank == 2), [float(rank + 1) if rank != 1 else 0.0, 12.0 * (rank == 1)],
                 torch.device("cpu"), torch.float32)
        for rank in range(3)
    ]  # fmt: skip
    summed = torch.stack(parts).sum(dim=0)
    verdict = verdict_of(summed, 2, torch.tensor(False), torch.tensor(0.5))
    assert verdict.tolist() == [1.0, 0.0, 0.5, 3.0, 12.0]
