"""Which overrides keep the training math: the class of a recommendation's lever, by the keys it sets.

Math-preserving levers change how a step is computed, not what it computes: loader workers, buckets, comm hooks
with error feedback, activation checkpointing, resharding, compile, logging, the micro-batch at the same global
batch (more or less accumulation) and the parallel layout at the same global batch. Everything else changes what
the optimizer sees (the global batch, precision, lossy gradient compression, optimizer settings) and is tried
only when ``tune.allow`` names its class. An unknown key is treated as changing the math: tune never guesses.
How often the run validates or saves (``pauses``) is never tried: tune's runs measure the steps, and the trade-off
(the loss curve's resolution, the work a crash loses) is the user's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from disttrain.config.levers import CATALOGUE, PRESERVING

# Keys -> lever class (the trainer's catalogue, config/levers.py); a class in PRESERVING keeps the training math
# (with the adjustments in ``classify``).
KEY_CLASSES = {lever.key: lever.lever for lever in CATALOGUE}
# What ``tune.allow`` may open: the classes that change what the optimizer computes.
MATH_CHANGING = ("global_batch", "precision", "lossy_comm", "other")
# Comm hooks that round gradients with no error feedback to carry the rounding into the next step.
LOSSY_HOOKS = ("bf16", "fp16")
GLOBAL_BATCH = "trainer.global_batch_size"
# Keys that set the global batch when it is not pinned (micro x dp x accumulation): a layout change moves dp.
GLOBAL_BATCH_MOVERS = ("layout", "micro_batch")


@dataclass(frozen=True)
class Lever:
    name: str  # one of PRESERVING or MATH_CHANGING
    preserves_math: bool
    why: str  # one line: why it does or does not keep the training math


def key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def value_of(override: str) -> str:
    return override.split("=", 1)[1] if "=" in override else ""


def _sets_global(overrides: Iterable[str], global_batch: int | None) -> bool:
    """Whether ``overrides`` pin the global batch at the run's own value."""
    wanted = None if global_batch is None else str(global_batch)
    return any(key_of(o) == GLOBAL_BATCH and value_of(o) == wanted for o in overrides)


def classify(
    key: str,
    value: str,
    pinned: Iterable[str],
    global_batch: int | None,
    error_feedback: bool = True,
) -> Lever:
    """The lever class of ``key=value`` (with its ``pinned`` overrides) on a run whose global batch is
    ``global_batch`` (None: unknown) and whose PowerSGD error feedback is ``error_feedback``."""
    name = KEY_CLASSES.get(key.lstrip("+~"), "other")
    pinned = list(pinned)
    if name == "comm_hook" and (value in LOSSY_HOOKS or not error_feedback):
        why = f"{key}={value} rounds gradients in transit with no error feedback to carry the rounding forward"
        return Lever("lossy_comm", False, why)
    if name == "micro_batch" and not _sets_global(pinned, global_batch):
        return Lever("global_batch", False, f"{key}={value} without the global batch pinned changes the batch size")
    if name in PRESERVING:
        kept = " at the same global batch" if name in GLOBAL_BATCH_MOVERS else ""
        return Lever(name, True, f"{name}{kept}: the same optimizer steps over the same tokens")
    if name == "pauses":
        # Tune's runs measure the steps' rate (and save no checkpoints): a pause lever shows only in the loop's.
        why = (
            f"{key}: how often the run validates or saves trades its loss curve or the work a crash loses for time, "
            "a choice tune leaves to you (python -m diagnose RUN --ab --run measures it)"
        )
        return Lever(name, False, why)
    if name == "other":
        return Lever(name, False, f"{key} is not a lever tune knows to keep the training math")
    return Lever(name, False, f"{key}={value} changes what the optimizer sees ({name})")


def global_pin(lever: Lever, overrides: Iterable[str], global_batch: int | None) -> str | None:
    """The override that keeps a layout change at the run's global batch (a new tp or pp moves dp, and an unpinned
    global batch is micro x dp): None when the overrides already set it or the global batch is unknown."""
    if lever.name != "layout" or global_batch is None or any(key_of(o) == GLOBAL_BATCH for o in overrides):
        return None
    return f"{GLOBAL_BATCH}={global_batch}"
