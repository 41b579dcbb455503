"""The calibrated collectives: this job's own measured bus bandwidth and per-call latency of all-reduce and all-gather,
the ranks' wait at a barrier, and how much of a collective hides behind compute on this host."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

# nccl-tests' bus-bandwidth factors: what each rank moves per byte of the full buffer, so one figure compares
# collectives and group sizes (and is the bandwidth the planner's link model divides by).
BUS_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}
BUS_FACTORS["reduce_scatter"] = BUS_FACTORS["all_gather"]
# The all-reduce as DTensor's tensor parallelism issues it: a functional collective (out of place, then a wait).
# On gloo it costs 1.5-2x the in-place all-reduce of the same bytes (2 CPU ranks: 3.5 vs 1.8 ms at 1.5 MiB, 12.2
# vs 7.9 ms at 8 MiB, interleaved), so TP runs measure it as its own op.
BUS_FACTORS["functional_all_reduce"] = BUS_FACTORS["all_reduce"]


# The latency is read off a call this many times smaller than the bandwidth's: the size of one FSDP unit's or one
# TP activation's collective. Gloo's all-reduce of 64 KiB-2 MiB costs ~3 ms on 2 CPU ranks where one element costs
# 0.27 ms and 8 MiB 8.6 ms (its algorithm changes with the size), so a one-element call's latency under-prices
# every tensor-sized call 3-10x.
LATENCY_SIZE_DIVISOR = 32


# Calls timed at that size for the latency (their median). On a shared 2-core box one call of a functional all-reduce
# of 256 KiB takes 0.4-4 ms depending on the moment: over 8 consecutive probes the median of 5 moved 0.4..4.3 ms (a
# TP run's predicted step by +-15%), the median of 15 0.4..0.8 ms (benchmarks/RESULTS.md, planner accuracy).
LATENCY_CALLS = 15


def collective_bandwidth(op: str, group: object | None, nbytes: int, device: torch.device, repeats: int = 3) -> dict:
    """Median time of ``op`` over a ``nbytes`` buffer (the full, unsharded size) in ``group`` after one warm-up;
    algorithm bandwidth = nbytes / time, bus bandwidth = algorithm bandwidth x the nccl-tests factor; and the
    latency, what a call costs beyond its bytes at that bandwidth: read off the median call over a
    ``LATENCY_SIZE_DIVISOR`` times smaller buffer (the size of the collectives a step issues), at least the fastest
    call over one element per rank (``call_latency_us``). Every rank of ``group`` must call it with the same
    arguments."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    seconds, size = _median_call(op, group, max(n, nbytes // 4 // n * n), n, device, repeats)
    small_numel = max(n, nbytes // LATENCY_SIZE_DIVISOR // 4 // n * n)
    small_seconds, small_size = _median_call(op, group, small_numel, n, device, max(repeats + 2, LATENCY_CALLS))
    call = _fastest_call(op, group, n, device)
    algbw = size / seconds / 1e9
    busbw = algbw * BUS_FACTORS[op](n)
    beyond_bytes = small_seconds - small_size * BUS_FACTORS[op](n) / (busbw * 1e9) if busbw > 0 else 0.0
    latency = max(call, beyond_bytes)
    return {
        "op": op,
        "ranks": n,
        "bytes": size,
        "seconds": seconds,
        "algbw_gbps": algbw,
        "busbw_gbps": busbw,
        "latency_us": latency * 1e6,
        "latency_bytes": small_size,
        "latency_call_s": small_seconds,
        "call_latency_us": call * 1e6,
    }


def _fastest_call(op: str, group: object | None, n: int, device: torch.device, repeats: int = 7) -> float:
    """The call's own cost over one element per rank: the fastest of ``repeats`` (a slower one waited for a rank
    the OS had descheduled, which the planner charges separately as drift: ``sync_wait``)."""
    return min(_call_times(op, group, n, n, device, repeats))


def _median_call(
    op: str, group: object | None, numel: int, n: int, device: torch.device, repeats: int
) -> tuple[float, int]:
    """(median seconds of one ``op`` call over ``numel`` fp32 elements, the buffer's bytes)."""
    times = sorted(_call_times(op, group, numel, n, device, repeats))
    return times[len(times) // 2], numel * 4


def _call_times(op: str, group: object | None, numel: int, n: int, device: torch.device, repeats: int) -> list[float]:
    """Seconds of ``repeats`` ``op`` calls over ``numel`` fp32 elements, each after a barrier, after one warm-up."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as functional

    full = torch.ones(numel, device=device, dtype=torch.float32)
    shard = torch.ones(numel // n, device=device, dtype=torch.float32)
    run = {
        "all_reduce": lambda: dist.all_reduce(full, group=group),
        "all_gather": lambda: dist.all_gather_into_tensor(full, shard, group=group),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full, group=group),
        "functional_all_reduce": lambda: functional.wait_tensor(
            functional.all_reduce(full, "sum", group if group is not None else dist.group.WORLD)
        ),
    }[op]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(repeats + 1):
        dist.barrier(group=group)
        sync()
        start = time.perf_counter()
        run()
        sync()
        if i:  # the first call sets up the connections
            times.append(time.perf_counter() - start)
    return times


def sync_wait(group: object | None, device: torch.device, rounds: int = 48) -> dict:
    """What a blocking collective costs right after the same work on every rank: ``rounds`` of (a fixed matmul
    segment, ~5 ms on CPU, then a one-element all-reduce), each rank's wait in every round. Per round, the last rank
    to arrive waits only for the call itself (cold: a progress thread that slept through the compute must wake),
    the others also for it: the planner's ``sync_overhead_us`` and ``compute_jitter`` (ranks drifting apart like
    random walks) come from those (``diagnostics.calibration``). Every rank of ``group`` must call it.

    The drift is a mean over rounds that a rare preempted round dominates: on 2 CPU ranks, five repeats of 12 rounds
    read sigma 0.0014-0.035, of 48 rounds 0.0054-0.017 (~0.3 s on CPU), and a plan's sync waits follow sigma."""
    import torch.distributed as dist

    n = 1024 if device.type == "cuda" else 192
    a = torch.randn(n, n, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ a
    sync()
    start = time.perf_counter()
    a @ a
    sync()
    target = 0.001 if device.type == "cuda" else 0.005
    # Every rank must do the same work: the most matmuls any rank needs for the target length.
    reps = torch.tensor([max(1, round(target / max(time.perf_counter() - start, 1e-6)))], device=device)
    dist.all_reduce(reps, op=dist.ReduceOp.MAX, group=group)
    reps_n = int(min(reps.item(), 1000))
    token = torch.ones(1, device=device)
    latency = _fastest_call("all_reduce", group, dist.get_world_size(group), device)
    segments, waits = [], []
    dist.barrier(group=group)
    for i in range(rounds + 1):
        sync()
        start = time.perf_counter()
        for _ in range(reps_n):
            a @ a
        sync()
        middle = time.perf_counter()
        dist.all_reduce(token, group=group)
        sync()
        if i:  # the first round pays any warm-up
            segments.append(middle - start)
            waits.append(time.perf_counter() - middle)
    return {
        "ranks": dist.get_world_size(group),
        "rounds": rounds,
        "segment_s": sum(segments) / rounds,
        "wait_s": sum(waits) / rounds,
        "waits_s": waits,
        "latency_s": latency,
    }


def comm_overlap(group: object | None, nbytes: int, device: torch.device, local_ranks: int, rounds: int = 3) -> dict:
    """How much of a collective this machine hides behind compute (the planner's ``hw.comm_overlap``).

    On a CPU host a collective is work for the host's cores (gloo's threads copy and reduce the bytes): compute
    hides it only where a core is left over beside each rank's compute threads, so the share is the spare cores per
    rank, clipped to [0, 1]. Counted, not timed: a wall-clock probe reads whatever the machine's load leaves free,
    while the ranks' CPU time says what the collectives cost (figures: benchmarks/RESULTS.md). On a GPU: a matmul
    segment alone, an all-reduce of ``nbytes`` alone, then both at once (issued asynchronously), each the median
    of ``rounds`` after a barrier: hidden = (compute + comm - both) / min(compute, comm). Every rank of ``group``
    must call it with the same arguments."""
    if device.type != "cuda":
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        threads = torch.get_num_threads()
        spare = cores / max(1, local_ranks) - threads
        return {
            "method": "spare_cores",
            "cores": cores,
            "local_ranks": local_ranks,
            "threads": threads,
            "hidden": min(1.0, max(0.0, spare)),
        }
    import torch.distributed as dist

    n = dist.get_world_size(group)
    full = torch.ones(max(n, nbytes // 4 // n * n), device=device)
    a = torch.randn(1024, 1024, device=device)

    def timed(work: Callable[[], None]) -> float:
        times = []
        for i in range(rounds + 1):
            dist.barrier(group=group)
            torch.cuda.synchronize()
            start = time.perf_counter()
            work()
            torch.cuda.synchronize()
            if i:  # the first round warms up
                times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    comm = timed(lambda: dist.all_reduce(full, group=group))
    one = timed(lambda: a @ a)
    # Every rank must do the same work: the most matmuls any rank needs to last as long as the collective.
    reps = torch.tensor([max(1, round(comm / max(one, 1e-6)))], device=device)
    dist.all_reduce(reps, op=dist.ReduceOp.MAX, group=group)
    reps_n = int(min(reps.item(), 10_000))

    def segment() -> None:
        for _ in range(reps_n):
            a @ a

    def both() -> None:
        work = dist.all_reduce(full, group=group, async_op=True)
        segment()
        work.wait()

    compute = timed(segment)
    together = timed(both)
    hidden = (compute + comm - together) / max(min(compute, comm), 1e-9)
    return {
        "method": "probe",
        "ranks": n,
        "bytes": full.numel() * 4,
        "compute_s": compute,
        "comm_s": comm,
        "both_s": together,
        "hidden": min(1.0, max(0.0, hidden)),
    }
