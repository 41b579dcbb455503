"""A user's LightningModule timed whole after training, at a micro-batch the run trained on (the parts record the
planner composes its step from: ``diagnostics.collect.parts.time_module_parts``).

The batch is kept from the steady run (past the first two, where the module's FLOPs are counted:
disttrain's training/flop_count.py, whose counter a probe's passes would join), and the probe runs once training has
ended: inside the loop it would be a pause of the tool's own between the user's steps. Per rank, no collectives,
the RNG as it was.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from diagnostics.collect.parts import time_module_parts
from diagnostics.collect.run_facts import RunFacts

PROBE_BATCH = 3  # the training batch kept for the probe, counted from 1


class ModuleTiming:
    """``batch_started`` on every training batch, ``run`` when training ends (``RunFacts.module_probe`` builds the
    parts: None where the module cannot be timed)."""

    def __init__(self, facts: RunFacts, calibrate: bool) -> None:
        self.probe = facts.module_probe if calibrate else None  # None: nothing kept, nothing timed
        self.micro_batch = facts.micro_batch_size
        self.precision = facts.precision
        self._started = 0
        self._batch: Any = None
        # The run's own peak before the probe's copy joined it (the allocator's on a GPU, the RSS's on a CPU): what
        # the run reports as its peak memory. None: no probe ran.
        self.peak_before: int | None = None

    def batch_started(self, batch: Any) -> None:
        self._started += 1
        if self._started == PROBE_BATCH and self.probe is not None:
            self._batch = batch

    def run(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        guarded: Callable[[str, Callable[[], Any]], Any],
        write: Callable[..., None],
    ) -> None:
        batch, self._batch, probe = self._batch, None, self.probe
        if batch is None or probe is None:
            return  # a run of fewer batches, or a module not timed
        device = module.device
        self.peak_before = peak_memory_bytes(device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            parts = guarded("parts_calibration", lambda: probe(module, batch, trainer))
            if not parts:
                return
            result = guarded(
                "parts_calibration", lambda: time_module_parts(device, parts, self.micro_batch, self.precision)
            )
        if result:
            write("parts_calibration", **result)


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak so far: the allocator's on a GPU, the resident set's on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
