"""The calibrated peak: this device's measured dense matmul FLOP/s, so MFU means something on a CPU or an
unknown GPU (datasheet peaks are unreachable upper bounds; this is what the silicon does here, now)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_clock(device: torch.device) -> tuple[str, Callable[[], float]]:
    """(name, clock) that times this process's own compute: on a GPU the wall clock (after a sync); on a CPU the
    CPU seconds of its compute threads (the calling thread's with one torch thread, else the process's over the
    thread count), which time the silicon's rate rather than the share of the cores other processes leave it: on
    a shared box the wall-clock rate of the same matmuls varied 3x between runs (load 5-10 on 2 cores)."""
    if device.type == "cuda":
        return "wall", time.perf_counter
    threads = max(1, torch.get_num_threads())
    if threads == 1:
        return "thread_cpu", time.thread_time
    return "process_cpu", lambda: time.process_time() / threads


def runqueue_seconds() -> float:
    """Seconds the calling thread has spent runnable but waiting for a core (Linux schedstat; 0 where the kernel does
    not report it): what separates a thread preempted by other processes from one blocked in a collective, which
    a wall clock minus a CPU clock cannot tell apart."""
    try:
        with open("/proc/thread-self/schedstat") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class LayerClock:
    """Seconds each module spends in its forward and in its backward on ``read`` (the wall clock by default), from
    hooks (``sync`` first: a GPU's queue): forward from its pre-hook to its hook, backward from the gradient of its
    output to the gradient of its input."""

    def __init__(
        self,
        modules: list[torch.nn.Module],
        sync: Callable[[], object] = lambda: None,
        read: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.sync, self.read = sync, read
        self.forward_s = [0.0] * len(modules)
        self.backward_s = [0.0] * len(modules)
        self._started: dict[tuple[str, int], float] = {}
        self._handles = []
        for i, module in enumerate(modules):
            self._handles += [
                module.register_forward_pre_hook(lambda *_, i=i: self._start("forward", i)),
                module.register_forward_hook(lambda *_, i=i: self._stop("forward", i, self.forward_s)),
                module.register_full_backward_pre_hook(lambda *_, i=i: self._start("backward", i)),
                module.register_full_backward_hook(lambda *_, i=i: self._stop("backward", i, self.backward_s)),
            ]

    def _start(self, phase: str, i: int) -> None:
        self.sync()
        self._started[(phase, i)] = self.read()

    def _stop(self, phase: str, i: int, into: list[float]) -> None:
        self.sync()
        into[i] += self.read() - self._started.pop((phase, i))

    @property
    def per_layer_s(self) -> list[float]:
        """Forward + backward of each module."""
        return [f + b for f, b in zip(self.forward_s, self.backward_s, strict=True)]

    def reset(self) -> None:
        self.forward_s = [0.0] * len(self.forward_s)
        self.backward_s = [0.0] * len(self.backward_s)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def matmul_flops_per_s(device: torch.device, dtype: str, min_seconds: float = 0.15) -> dict:
    """Time square matmuls for at least ``min_seconds`` (on ``compute_clock``) after a warm-up; 2*n^3 FLOPs each.
    The wall time it took is ``wall_s`` (at most a few times ``min_seconds`` on a loaded host)."""
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
    b = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
    for _ in range(2):
        a @ b
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    name, clock = compute_clock(device)
    iterations, start, wall = 0, clock(), time.perf_counter()
    while True:
        a @ b
        iterations += 1
        if iterations % 4 == 0:
            sync()
            elapsed = clock() - start
            if elapsed >= min_seconds:
                break
    return {
        "dtype": dtype,
        "matrix_size": n,
        "flops_per_s": 2 * n**3 * iterations / elapsed,
        "seconds": elapsed,
        "clock": name,
        "wall_s": time.perf_counter() - wall,
    }


def memory_bandwidth_gbps(device: torch.device, nbytes: int = 32 * 2**20, repeats: int = 3) -> float:
    """Streaming bandwidth of ``a = b + c`` (three buffers of ``nbytes`` moved): what a memory-bound optimizer step
    runs at on this device."""
    numel = nbytes // 4
    b, c = torch.ones(numel, device=device), torch.ones(numel, device=device)
    a = torch.empty_like(b)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(repeats + 1):
        sync()
        start = time.perf_counter()
        torch.add(b, c, out=a)
        sync()
        if i:
            times.append(time.perf_counter() - start)
    return 3 * numel * 4 / sorted(times)[len(times) // 2] / 1e9
