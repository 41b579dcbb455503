"""What FSDP2's sharded (DTensor) parameters add to the step's tail: the gradients' global norm, clipping with it and
the run's AdamW step dispatch every op per DTensor (sharding propagation, local views, a reduction over the group for
the norm), a host cost per parameter tensor that the plain parameters' share of the same tail does not have.

Measured on units of tiny linears (their math is negligible, so what is left is the per-tensor dispatch) at two
tensor counts, sharded and plain, in alternation: the extra's slope is the cost per parameter tensor, its intercept
the cost per step (the norm's reduction). On two CPU ranks it was ~160 us per tensor and ~1 ms per step, the same
as over copies of the run's own gpt-nano and HF Llama blocks (benchmarks/RESULTS.md): gpt-nano's FSDP optimizer
phase measured 19.6 ms where the plan had 4.2 ms."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from diagnostics.collect.calibrate import compute_clock
from diagnostics.collect.calibrate_parallel import group_mesh

# Linear layers of each probe unit (two parameter tensors each): the slope between them is the per-tensor cost.
UNIT_LINEARS = (4, 12)
UNIT_WIDTH = 16

StepTail = Callable[[torch.nn.Module], Callable[[], None]]


def _unit(linears: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(UNIT_WIDTH, UNIT_WIDTH) for _ in range(linears)]).to(device)


def _with_gradients(module: torch.nn.Module) -> torch.nn.Module:
    # The tail only reads the gradients: a pass would add nothing but time (full_like keeps a DTensor's placements;
    # a random op on a DTensor over a CPU mesh warns).
    for p in module.parameters():
        p.grad = torch.full_like(p, 1e-3)
    return module


def fsdp_step_overhead(device: torch.device, shard_ranks: int, step_tail: StepTail, repeats: int = 8) -> dict:
    """Host cost FSDP2 adds to the step's tail (``step_tail(module)``: the run's norm, clipping and AdamW over a
    module's gradients) beyond ``1 / shard_ranks`` of the plain parameters' tail: ``step_tensor_us`` per sharded
    parameter tensor and ``step_fixed_us`` per step (``hw.fsdp_step_tensor_us``, ``hw.fsdp_step_fixed_us``). Units
    sharded over groups of ``shard_ranks`` ranks (the run's FSDP2 degree); the median of ``repeats`` paired
    differences on ``compute_clock`` after one call that allocates the moments. Every rank must call it."""
    from torch.distributed.fsdp import fully_shard

    start = time.perf_counter()
    mesh = group_mesh(device, shard_ranks)
    _, clock = compute_clock(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    extra: dict[int, float] = {}
    tensors: dict[int, int] = {}
    for linears in UNIT_LINEARS:
        plain, sharded = _unit(linears, device), _unit(linears, device)
        fully_shard(sharded, mesh=mesh)
        tails = [step_tail(_with_gradients(plain)), step_tail(_with_gradients(sharded))]
        for tail in tails:
            tail()
        differences = []
        for _ in range(repeats):
            seconds = []
            for tail in tails:
                sync()
                begin = clock()
                tail()
                sync()
                seconds.append(clock() - begin)
            differences.append(seconds[1] - seconds[0] / shard_ranks)
        extra[linears] = statistics.median(differences)
        tensors[linears] = sum(1 for _ in plain.parameters())
    few, many = UNIT_LINEARS
    per_tensor = max(0.0, (extra[many] - extra[few]) / (tensors[many] - tensors[few]))
    return {
        "step_extra_s": {str(tensors[n]): seconds for n, seconds in extra.items()},
        "step_tensor_us": per_tensor * 1e6,
        "step_fixed_us": max(0.0, extra[few] - per_tensor * tensors[few]) * 1e6,
        "step_wall_s": time.perf_counter() - start,
    }
