"""Lightning's loop counters restated for the run that resumes, so a checkpoint continues under another layout.

Lightning saves its fit loop as counters: loader batches (``batch_progress``) and optimizer steps, the latter under
automatic optimization (DDP, FSDP, DeepSpeed) or manual optimization (Megatron's engine steps itself). Both depend
on how the checkpoint's writer ran a step: a run with 2 accumulated micro-batches per step has counted twice the
batches of one without, and a Megatron checkpoint carries its steps in the manual counters only. Restored verbatim
under another layout, the accumulation boundary would fall mid-step and a manual/automatic switch would start the
step count from zero.

The invariant is the optimizer step: a checkpoint is always taken at a step boundary, so the batch counters are
rebased to ``steps x batches_per_step`` of the resuming run and the step counters of its optimization mode are set to
``steps``; the other mode's counters are zeroed. For a resume under the writer's own layout every value maps to
itself (the bitwise same-layout resume is untouched).
"""

from __future__ import annotations

from typing import Any

BATCHES = "epoch_loop.batch_progress"
AUTOMATIC_STEP = "epoch_loop.automatic_optimization.optim_progress"
MANUAL_STEP = "epoch_loop.manual_optimization.optim_step_progress"
COUNTS = ("ready", "started", "processed", "completed")


def _rebase(progress: dict[str, Any], ratio: float) -> None:
    """Scale each scope's batch count by ``ratio`` (new over old batches per step), keeping the counters' offsets."""
    for scope in ("total", "current"):
        counts = progress.get(scope, {})
        if "ready" not in counts:
            continue
        delta = round(counts["ready"] * ratio) - counts["ready"]
        for key in COUNTS:
            if key in counts:
                counts[key] += delta


def _set(progress: dict[str, Any], value: int) -> None:
    for scope in ("total", "current"):
        for key in COUNTS:
            if key in progress.get(scope, {}):
                progress[scope][key] = value


def restate_fit_loop(fit_loop: dict[str, Any], steps: int, batches_per_step: int, manual: bool) -> dict[str, Any]:
    """The fit loop's saved state (``checkpoint["loops"]["fit_loop"]``) for a run stepping every ``batches_per_step``
    loader batches with ``manual`` optimization, at optimizer step ``steps``; changed in place and returned."""
    batches = fit_loop.get(BATCHES)
    if batches is not None and steps > 0:
        # Saved at the end of the step's last batch: "ready" counts it, "completed" not yet; the offsets are kept.
        _rebase(batches, steps * batches_per_step / batches["total"]["ready"])
    automatic = fit_loop.get(AUTOMATIC_STEP)
    if automatic is not None:
        for part in automatic.get("optimizer", {}).values():
            _set(part, 0 if manual else steps)
    manual_steps = fit_loop.get(MANUAL_STEP)
    if manual_steps is not None:
        _set(manual_steps, steps if manual else 0)
    return fit_loop
