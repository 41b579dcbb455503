"""The run's own parts, timed at start-up: forward and backward of one transformer block and of the model's edges
(embedding, final norm, LM head and the loss) at the run's micro-batch, sequence length and precision on the run's
device, and one optimizer step over a block's parameters. The planner composes each layout's step from them
(``disttrain.planner.measured``): what a FLOPs-over-matmul-rate estimate misses (non-matmul kernels, autograd, the
optimizer, launch overhead) is in the measurement.

An HF model comes as its own config at two layers (``disttrain.models.probe_parts.hf_model_parts``): hooks time each
decoder layer's forward and backward inside the whole model's passes, and the rest of each pass is the edges.

Wall clock, each part the median of ``repeats`` after a warm-up, every rank at once (the probe runs in ``setup`` on
all ranks): on a host whose cores the ranks share, the parts then see the contention the training steps will see.
Parts marked ``gpu_clock`` (a run whose blocks replay as CUDA graphs) are timed on the GPU's clock instead: passes
queued back to back, as a replay keeps the GPU fed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from diagnostics.collect.calibrate import LayerClock, compute_clock
from diagnostics.collect.unhooked import unhooked_step

# Warm-up passes of each part on a CPU, at least: a fresh process's first passes at the run's shapes read slow
# (which of the host's allocator and caches settles is not isolated). 2 gloo ranks of gpt-micro, one warm-up
# pass: the composed parts 1.06-1.16x the whole model's pass measured right after (median 1.11); three:
# 0.96-1.11 (1.02). A pipeline multiplies the over-read by its bubble (pp=2 +19% -> +3%: benchmarks/RESULTS.md).
CPU_WARMUP_PASSES = 3


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


def _layers_in_model(
    parts: dict, tokens: torch.Tensor, targets: torch.Tensor, device: torch.device, repeats: int
) -> tuple[float, float, float, float]:
    """(block forward, block backward, edges forward, edges backward) seconds: each pass of the whole model (tokens
    to loss) with its layers timed by hooks; a block is the layers' mean, the edges the rest of the pass."""
    model, layers, autocast = parts["model"], list(parts["layers"]), parts["autocast"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = LayerClock(layers, sync)
    samples: list[tuple[float, float, float, float]] = []
    try:
        for i in range(repeats + 1):  # the first pass warms up
            clock.reset()
            sync()
            start = time.perf_counter()
            with autocast():
                logits = model(tokens)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets)
            sync()
            middle = time.perf_counter()
            loss.backward()
            sync()
            end = time.perf_counter()
            if i:
                block_f, block_b = statistics.mean(clock.forward_s), statistics.mean(clock.backward_s)
                edges_f = max(0.0, middle - start - sum(clock.forward_s))
                edges_b = max(0.0, end - middle - sum(clock.backward_s))
                samples.append((block_f, block_b, edges_f, edges_b))
    finally:
        clock.remove()
    medians = [statistics.median(column) for column in zip(*samples, strict=True)]
    return medians[0], medians[1], medians[2], medians[3]


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def _block_and_edges(
    parts: dict, tokens: torch.Tensor, targets: torch.Tensor, device: torch.device, repeats: int
) -> tuple[float, float, float, float, dict[str, float | None]]:
    """(block forward, block backward, edges forward, edges backward) seconds, each module on its own: the block on
    a hidden state that requires grad, as inside the model (its backward computes the input gradient too); and on a
    GPU the allocator's bytes: what the block keeps from its forward for its backward (with its output), and the
    edges' peak over forward and backward (the logits, the loss's fp32 work, their gradients)."""
    block, edges, autocast = parts["block"], parts["edges"], parts["autocast"]
    rope = parts["rope"] or ()
    hidden = torch.randn(*tokens.shape, parts["d_model"], device=device, dtype=parts["param_dtype"], requires_grad=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def block_forward() -> torch.Tensor:
        with autocast():
            return block(hidden, *rope)

    loss = parts.get("loss") or _cross_entropy
    warmup = int(parts.get("warmup", 1))
    if device.type == "cpu":
        warmup = max(warmup, CPU_WARMUP_PASSES)

    def edges_forward() -> torch.Tensor:
        with autocast():
            logits = edges(tokens)
        return loss(logits, targets)

    cuda = device.type == "cuda"
    # A run whose compiled blocks replay as CUDA graphs keeps the GPU busy (no launch gaps): its parts take what
    # their kernels take on the GPU's clock, the host running ahead, not a synchronised pass's wall time.
    gpu_clock = cuda and bool(parts.get("gpu_clock"))

    def forward_backward(forward: Callable[[], torch.Tensor]) -> tuple[float, float, float | None, float | None]:
        forward_s, backward_s = [], []
        kept = peak = None
        # The first passes warm up (allocator, kernels' first launch; a compiled block compiles in its first).
        synced = warmup if gpu_clock else repeats + warmup
        for i in range(synced):
            sync()
            before = torch.cuda.memory_allocated(device) if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            out = forward()
            sync()
            middle = time.perf_counter()
            if cuda:  # the graph's saved tensors and the output, alive until backward
                kept = float(torch.cuda.memory_allocated(device) - before)
            out.float().sum().backward()
            sync()
            if cuda:
                peak = float(torch.cuda.max_memory_allocated(device) - before)
            if i >= warmup:
                forward_s.append(middle - start)
                backward_s.append(time.perf_counter() - middle)
            del out
        if gpu_clock:
            # The last warm-up pass's wall time (synchronised) bounds what the host takes to queue one.
            queue_s = time.perf_counter() - start
            forward_s, backward_s = _gpu_clock_passes(forward, max(repeats, GPU_CLOCK_REPEATS), queue_s)
        return statistics.median(forward_s), statistics.median(backward_s), kept, peak

    block_f, block_b, block_kept, _ = forward_backward(block_forward)
    edges_f, edges_b, _, edges_peak = forward_backward(edges_forward)
    memory = {"block_activation_bytes": block_kept, "edges_peak_bytes": edges_peak}
    return block_f, block_b, edges_f, edges_b, memory


# Passes timed back to back on the GPU's clock: a few more than the wall clock's, since they cost no synchronisation.
GPU_CLOCK_REPEATS = 5
# GPU clock cycles per second of hold: at least a second's worth at any clock a current GPU runs (H100/H200 boost
# ~1.98 GHz); a lower clock only holds longer.
HOLD_CYCLES_PER_S = 2.5e9


def _held_gpu_seconds(segments: list[Callable[[], object]], repeats: int, queue_s: float) -> list[list[float]]:
    """Seconds of each of ``segments`` (run in order, ``repeats`` times) read from CUDA events, the GPU held while
    the host queues them all (``queue_s`` bounds one round's queueing): the kernels' time alone, as a graph replay
    runs them (at micro 16, gpt2-124m's compiled block queued its passes slower than the GPU ran them)."""
    torch.cuda._sleep(int(HOLD_CYCLES_PER_S * 1.5 * queue_s * repeats))
    marks = [[torch.cuda.Event(enable_timing=True) for _ in range(len(segments) + 1)] for _ in range(repeats)]
    for events in marks:
        events[0].record()
        for segment, event in zip(segments, events[1:], strict=True):
            segment()
            event.record()
    torch.cuda.synchronize()
    return [[events[i].elapsed_time(events[i + 1]) / 1e3 for events in marks] for i in range(len(segments))]


def _gpu_clock_passes(
    forward: Callable[[], torch.Tensor], repeats: int, queue_s: float
) -> tuple[list[float], list[float]]:
    """Forward and backward seconds of ``repeats`` passes on the GPU's clock (``_held_gpu_seconds``)."""
    outputs: list[torch.Tensor] = []

    def backward() -> None:
        outputs.pop().float().sum().backward()

    forward_s, backward_s = _held_gpu_seconds([lambda: outputs.append(forward()), backward], repeats, queue_s)
    return forward_s, backward_s


def time_model_parts(device: torch.device, parts: dict, micro_batch: int, repeats: int = 2) -> dict:
    """Seconds of one micro-batch's forward and backward through ``parts["block"]`` and ``parts["edges"]`` and of
    one ``parts["optimizer"]()`` step over the block's parameters (``disttrain.models.probe_parts.model_parts``,
    or ``hf_model_parts``: its ``layers`` timed inside its ``model``'s passes)."""
    start = time.perf_counter()
    _, clock = compute_clock(device)
    cpu_start = clock()
    seq, d, vocab = parts["seq_len"], parts["d_model"], parts["vocab_size"]
    generator = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, vocab, (micro_batch, seq), generator=generator).to(device)
    targets = torch.randint(0, vocab, (micro_batch * seq,), generator=generator).to(device)
    # An HF model's layers are timed inside its passes, where one layer's memory is not apart from the others'.
    memory: dict[str, float | None] = {"block_activation_bytes": None, "edges_peak_bytes": None}
    if "layers" in parts:
        block_f, block_b, edges_f, edges_b = _layers_in_model(parts, tokens, targets, device, repeats)
    else:
        block_f, block_b, edges_f, edges_b, memory = _block_and_edges(parts, tokens, targets, device, repeats)
    optimizer = parts["optimizer"]()
    step = unhooked_step(optimizer)  # not the run's step: a user's global optimizer hooks must not see it
    step()  # the first step allocates the moments
    optimizer_s = _median_seconds(step, device, repeats)
    if parts.get("gpu_clock") and device.type == "cuda":
        # The run steps all its parameters in one fused call: a block's share is its kernels' time, not the host's
        # fixed cost of a call (scaled by the blocks, that cost put gpt2-124m's step +16% on an H200).
        optimizer_s = statistics.median(_held_gpu_seconds([step], GPU_CLOCK_REPEATS, optimizer_s)[0])
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
        **memory,  # on a GPU (None on a CPU, whose allocator keeps no count)
        "repeats": repeats,
        "compiled": parts.get("compiled"),  # the block's torch.compile mode, None when timed eager
        "clock": "gpu" if parts.get("gpu_clock") and device.type == "cuda" else "wall",
        "wall_s": time.perf_counter() - start,
        # The cores this rank's compute threads got while it probed (on a CPU; ~1 when the host is the run's alone):
        # a run's wall-clock step stretches by about the inverse of its share, so a share that differs between the
        # probe and the run is what its prediction error follows (benchmarks/plan_accuracy.py prints both).
        "cpu_share": (clock() - cpu_start) / max(time.perf_counter() - start, 1e-9) if device.type == "cpu" else None,
    }


def time_module_parts(device: torch.device, parts: dict, micro_batch: int, precision: str, repeats: int = 3) -> dict:
    """Seconds of a whole module's training step on one micro-batch, its backward and its optimizer step
    (``disttrain.training.module_probe.module_parts``), as the parts record the planner reads: the module is all
    "edges" (no blocks: it has no layers the planner knows), its sample the unit (``seq_len`` 1), its parameters the
    optimizer's. Each part is the median of ``repeats`` after the CPU's warm-up passes."""
    start = time.perf_counter()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    forward, backward, step = parts["forward"], parts["backward"], parts["optimizer"]
    times: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    warmup = CPU_WARMUP_PASSES if device.type == "cpu" else 1
    for i in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        loss = forward()
        sync()
        t1 = time.perf_counter()
        backward(loss)
        sync()
        t2 = time.perf_counter()
        step()
        sync()
        t3 = time.perf_counter()
        if i >= warmup:
            for name, seconds in (("forward", t1 - t0), ("backward", t2 - t1), ("optimizer", t3 - t2)):
                times[name].append(seconds)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the copy's blocks are not the run's
    return {
        "micro_batch": micro_batch,
        "seq_len": 1,
        "d_model": 0,
        "vocab_size": 0,
        "block_numel": parts["numel"],
        "block_forward_s": 0.0,
        "block_backward_s": 0.0,
        "edges_forward_s": statistics.median(times["forward"]),
        "edges_backward_s": statistics.median(times["backward"]),
        "optimizer_step_s": statistics.median(times["optimizer"]),
        "block_activation_bytes": None,
        "edges_peak_bytes": None,
        "precision": precision,
        "repeats": repeats,
        "compiled": None,
        "clock": "wall",
        "whole_module": True,
        "wall_s": time.perf_counter() - start,
        "cpu_share": None,
    }
