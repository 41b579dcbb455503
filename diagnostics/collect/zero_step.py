"""What DeepSpeed's ZeRO-1/2 engine adds on the host beyond the math and the collectives the link model prices: in
backward a Python hook per parameter copying its gradient into the reduction bucket, in the step the overflow
check, the norm, the gradients flattened into this rank's partition, clipping, AdamW over the partition and the
copy back into the parameters' flat buffer (``disttrain.strategies.zero_probe`` builds the engines).

Measured as the run measures everything else it composes: plain and under the run's engine in alternation, on
``compute_clock`` (CPU time on a CPU: the time an engine's collectives keep a rank waiting is priced by the link
model, not here), backward and step apart. Twice: on a unit of tiny linears, whose math and bytes are negligible,
for what a step and a micro-batch cost whatever the model (``*_fixed_us``), and on a small copy of the run's own
model, whose extra beyond that is charged per byte of its parameters (``*_ns_per_byte``: backward per byte of the
model, each micro-batch; the step per byte of the rank's partition)."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from diagnostics.collect.calibrate import compute_clock

UNIT_LINEARS = 4
UNIT_WIDTH = 16

StepTail = Callable[[torch.nn.Module], Callable[[], None]]


def zero_overhead(
    device: torch.device,
    parts: Callable[[], dict],
    step_tail: StepTail,
    micro_batch: int,
    dp: int,
    repeats: int = 6,
) -> dict:
    """ZeRO's host cost per micro-batch (``backward_fixed_us`` + ``backward_ns_per_byte`` x the model's parameter
    bytes) and per step (``step_fixed_us`` + ``step_ns_per_byte`` x the partition's bytes, 1/``dp`` of them): the
    medians of ``repeats`` paired differences, engine minus plain (``step_tail(module)``: the run's norm, clipping
    and AdamW), each step over the run's ``accumulation`` micro-batches (ZeRO-2 reduces every one and adds it into
    its partition). ``parts()``: ``model`` (tokens -> logits), ``engine(module)``, ``accumulation``, ``vocab_size``,
    ``seq_len``. Every rank must call it (the engines reduce over the run's ranks)."""
    start = time.perf_counter()
    p = parts()
    engine: Callable[[torch.nn.Module], Any] = p["engine"]
    accumulation = int(p.get("accumulation", 1))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unit = torch.nn.Sequential(*[torch.nn.Linear(UNIT_WIDTH, UNIT_WIDTH) for _ in range(UNIT_LINEARS)]).to(device)
        inputs = torch.randn(micro_batch, UNIT_WIDTH, device=device)
        tokens = torch.randint(0, p["vocab_size"], (micro_batch, p["seq_len"]), device=device)
    targets = tokens.roll(-1, dims=1).reshape(-1)

    def unit_loss(module: torch.nn.Module) -> torch.Tensor:
        return module(inputs).float().pow(2).mean()

    def model_loss(module: torch.nn.Module) -> torch.Tensor:
        logits = module(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets)

    fixed = _paired_steps(unit, engine, step_tail, unit_loss, device, repeats, accumulation)
    model = p["model"]
    measured = _paired_steps(model, engine, step_tail, model_loss, device, repeats, accumulation)
    param_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    backward_net = max(0.0, measured["backward_extra_s"] - fixed["backward_extra_s"])
    step_net = max(0.0, measured["step_extra_s"] - fixed["step_extra_s"])
    return {
        "dp": dp,
        "accumulation": accumulation,
        "param_bytes": param_bytes,
        "unit": fixed,
        "model": measured,
        "backward_fixed_us": max(0.0, fixed["backward_extra_s"]) / accumulation * 1e6,
        "step_fixed_us": max(0.0, fixed["step_extra_s"]) * 1e6,
        "backward_ns_per_byte": backward_net / accumulation / param_bytes * 1e9,
        "step_ns_per_byte": step_net / (param_bytes / dp) * 1e9,
        "zero_wall_s": time.perf_counter() - start,
    }


def _paired_steps(
    plain: torch.nn.Module,
    engine: Callable[[torch.nn.Module], Any],
    step_tail: StepTail,
    loss: Callable[[torch.nn.Module], torch.Tensor],
    device: torch.device,
    repeats: int,
    accumulation: int = 1,
) -> dict[str, float]:
    """Training steps of ``plain`` (``accumulation`` backward passes, then its step tail) and of ``engine`` over a copy
    of it (as the run drives it: each micro-batch's backward, then its step, which only the last one takes) in
    alternation, two warm-up rounds first (the moments, the engine's buffers), on ``compute_clock``: the median over
    rounds of each segment's difference (the micro-batches, then the last step), engine minus plain."""
    _, clock = compute_clock(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    wrapped = engine(copy.deepcopy(plain))
    plain_step = step_tail(plain)

    def plain_backward() -> None:
        for _ in range(accumulation):
            loss(plain).backward()

    def plain_update() -> None:
        plain_step()
        plain.zero_grad(set_to_none=True)

    def engine_backward() -> None:
        for micro_batch in range(accumulation):
            wrapped.backward(loss(wrapped))
            if micro_batch < accumulation - 1:
                wrapped.step()  # not at the accumulation boundary: the engine only counts the micro-batch

    segments = ((plain_backward, plain_update), (engine_backward, wrapped.step))
    seconds: list[list[list[float]]] = [[[], []], [[], []]]
    for i in range(repeats + 2):
        for which, (backward, update) in enumerate(segments):
            for part, run in enumerate((backward, update)):
                sync()
                begin = clock()
                run()
                sync()
                if i >= 2:
                    seconds[which][part].append(clock() - begin)
    extra = [
        statistics.median(o - q for q, o in zip(seconds[0][part], seconds[1][part], strict=True)) for part in (0, 1)
    ]
    return {
        "plain_backward_s": statistics.median(seconds[0][0]),
        "plain_step_s": statistics.median(seconds[0][1]),
        "backward_extra_s": extra[0],
        "step_extra_s": extra[1],
    }
