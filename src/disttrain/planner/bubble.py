"""Pipeline schedules: the idle fraction (bubble) and how many micro-batches a stage holds activations for.

Bubble fractions are Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", sec. 2.2): bubble time over ideal compute time, ``(p-1)/m`` for GPipe and 1F1B and
``(p-1)/(v m)`` for the interleaved schedule with ``v`` model chunks per rank. 1F1B has GPipe's bubble but
caps the micro-batches in flight at ``p`` instead of ``m``. The zero-bubble V schedule (Qi et al. 2024,
"Pipeline Parallelism with Controllable Memory"; torch's ``ScheduleZBVZeroBubble``) fills the bubble with the
deferred weight-gradient passes at 1F1B's peak activation memory.
"""

from __future__ import annotations

# The schedule is built to leave no idle slot in steady state; the residual from unequal forward, input-grad and
# weight-grad times is not modelled.
ZERO_BUBBLE_FRACTION = 0.0


def bubble_fraction(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Pipeline bubble as a fraction of ideal compute time (so step time = compute x (1 + bubble))."""
    if pp == 1 or schedule == "none":
        return 0.0
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / microbatches
    if schedule == "interleaved_1f1b":
        return (pp - 1) / (virtual_stages * microbatches)
    if schedule == "zero_bubble":
        return ZERO_BUBBLE_FRACTION
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def microbatches_in_flight(schedule: str, pp: int, microbatches: int, virtual_stages: int, stage: int) -> float:
    """Micro-batches whose activations pipeline rank ``stage`` holds at its peak, in units of its L/p layers.

    GPipe runs every forward before any backward (m in flight); 1F1B's warm-up on rank i is p - i forwards.
    Megatron's interleaved schedule warms up ``2 (p - i - 1) + (v - 1) p`` chunk forwards, each chunk L/(p v)
    layers, which for rank 0 is Korthikanti et al.'s ``p (1 + (p-1)/(p v))``. The zero-bubble V schedule
    balances memory over ranks at 1F1B's rank-0 peak.
    """
    if pp == 1 or schedule == "none":
        return 1.0
    if schedule == "gpipe":
        return float(microbatches)
    if schedule == "1f1b":
        return float(min(pp - stage, microbatches))
    if schedule == "interleaved_1f1b":
        chunks = 2 * (pp - stage - 1) + (virtual_stages - 1) * pp + 1
        return min(chunks, microbatches * virtual_stages) / virtual_stages
    if schedule == "zero_bubble":
        return float(min(pp, microbatches))
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def stages_of_rank(rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """Pipeline stages (model chunks) pipeline rank ``rank`` runs, as ``disttrain.models.pipeline`` places them.

    Looped for interleaved 1F1B (rank r runs r, r + p, ...); V-shaped for the zero-bubble V (r and 2p - 1 - r),
    which puts the last stage, the head and the loss, on rank 0 beside the first.
    """
    if pp == 1 or schedule == "none":
        return [0]
    if schedule == "zero_bubble":
        return [rank, 2 * pp - 1 - rank]
    chunks = virtual_stages if schedule == "interleaved_1f1b" else 1
    return [rank + chunk * pp for chunk in range(chunks)]


def last_stage_rank(pp: int, schedule: str) -> int:
    """The pipeline rank holding the head and the loss."""
    return 0 if schedule == "zero_bubble" else pp - 1
