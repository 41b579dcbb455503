"""The run's own parts, timed at start-up: forward and backward of one transformer block and of the model's edges
(embedding, final norm, LM head and the loss) at the run's micro-batch, sequence length and precision on the run's
device, and one optimizer step over a block's parameters. The planner composes each layout's step from them
(``disttrain.planner.measured``): what a FLOPs-over-matmul-rate estimate misses (non-matmul kernels, autograd, the
optimizer, launch overhead) is in the measurement.

Wall clock, each part the median of ``repeats`` after a warm-up, every rank at once (the probe runs in ``setup`` on
all ranks): on a host whose cores the ranks share, the parts then see the contention the training steps will see.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from diagnostics.collect.calibrate import compute_clock


def _median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_model_parts(device: torch.device, parts: dict, micro_batch: int, repeats: int = 2) -> dict:
    """Seconds of one micro-batch's forward and backward through ``parts["block"]`` and ``parts["edges"]`` and of
    one ``parts["optimizer"]()`` step over the block's parameters (``disttrain.models.probe_parts.model_parts``).
    The block's input requires grad, as inside the model (its backward computes the input gradient too)."""
    start = time.perf_counter()
    _, clock = compute_clock(device)
    cpu_start = clock()
    block, edges, autocast = parts["block"], parts["edges"], parts["autocast"]
    seq, d, vocab = parts["seq_len"], parts["d_model"], parts["vocab_size"]
    rope = parts["rope"] or ()
    hidden = torch.randn(micro_batch, seq, d, device=device, dtype=parts["param_dtype"], requires_grad=True)
    generator = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, vocab, (micro_batch, seq), generator=generator).to(device)
    targets = torch.randint(0, vocab, (micro_batch * seq,), generator=generator).to(device)

    def block_forward() -> torch.Tensor:
        with autocast():
            return block(hidden, *rope)

    def edges_forward() -> torch.Tensor:
        with autocast():
            logits = edges(tokens)
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def forward_backward(forward: Callable[[], torch.Tensor]) -> tuple[float, float]:
        forward_s, backward_s = [], []
        for i in range(repeats + 1):  # the first pass warms up (allocator, kernels' first launch)
            sync()
            start = time.perf_counter()
            out = forward()
            sync()
            middle = time.perf_counter()
            out.float().sum().backward()
            sync()
            if i:
                forward_s.append(middle - start)
                backward_s.append(time.perf_counter() - middle)
        return statistics.median(forward_s), statistics.median(backward_s)

    block_f, block_b = forward_backward(block_forward)
    edges_f, edges_b = forward_backward(edges_forward)
    optimizer = parts["optimizer"]()
    optimizer.step()  # the first step allocates the moments
    optimizer_s = _median_seconds(optimizer.step, device, repeats)
    del optimizer
    if device.type == "cuda":
        # The probe's activations are not the run's: give the allocator's blocks back, and keep its peak (a pipeline's
        # first stage never holds logits in training) out of the run's measured allocator peak.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return {
        "micro_batch": micro_batch,
        "seq_len": seq,
        "d_model": d,
        "vocab_size": vocab,
        "block_numel": parts["block_numel"],
        "block_forward_s": block_f,
        "block_backward_s": block_b,
        "edges_forward_s": edges_f,
        "edges_backward_s": edges_b,
        "optimizer_step_s": optimizer_s,
        "repeats": repeats,
        "clock": "wall",
        "wall_s": time.perf_counter() - start,
        # The cores this rank's compute threads got while it probed (on a CPU; ~1 when the host is the run's alone):
        # a run's wall-clock step stretches by about the inverse of its share, so a share that differs between the
        # probe and the run is what its prediction error follows (benchmarks/plan_accuracy.py prints both).
        "cpu_share": (clock() - cpu_start) / max(time.perf_counter() - start, 1e-9) if device.type == "cpu" else None,
    }
