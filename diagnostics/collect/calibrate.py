"""The calibrated peak: this device's measured dense matmul FLOP/s, so MFU means something on a CPU or an
unknown GPU (datasheet peaks are unreachable upper bounds; this is what the silicon does here, now)."""

from __future__ import annotations

import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def matmul_flops_per_s(device: torch.device, dtype: str, min_seconds: float = 0.3) -> dict:
    """Time square matmuls for at least ``min_seconds`` after a warm-up; 2*n^3 FLOPs each."""
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
    b = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
    for _ in range(2):
        a @ b
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    iterations, start = 0, time.perf_counter()
    while True:
        a @ b
        iterations += 1
        if iterations % 4 == 0:
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
    return {"dtype": dtype, "matrix_size": n, "flops_per_s": 2 * n**3 * iterations / elapsed, "seconds": elapsed}
