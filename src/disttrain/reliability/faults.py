"""Deliberate failures for testing recovery: ``DISTTRAIN_FAULT=sigkill@step=7,rank=1``.

Recovery code is only trustworthy if it is exercised. This kills a chosen rank with SIGKILL (which nothing can
catch or clean up after: what a machine failure or the OOM killer does) at a precise point:

- ``step=N``: right after optimizer step N completed on that rank;
- ``save=N``: during the checkpoint save of step N, after every rank wrote its part and before the checkpoint
  is renamed to its final name (what is on disk is then exactly what a kill mid-save leaves);

on ``rank=R`` (global rank, default 0) in restart attempt ``attempt=A`` (default 0, so a restarted run
does not die again at the same point). Unset, nothing here runs.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import lightning.pytorch as pl

FAULT_ENV = "DISTTRAIN_FAULT"
WHERE = ("step", "save")


@dataclass(frozen=True)
class Fault:
    where: str  # step | save
    step: int
    rank: int = 0
    attempt: int = 0


def parse_fault(spec: str) -> Fault:
    """``sigkill@step=7[,rank=1][,attempt=0]`` -> Fault (ValueError naming the problem otherwise)."""
    what, _, args = spec.partition("@")
    if what != "sigkill":
        raise ValueError(f"{FAULT_ENV}: unknown fault '{what}' (only sigkill)")
    fields: dict[str, int] = {}
    for item in filter(None, args.split(",")):
        key, _, value = item.partition("=")
        if key not in (*WHERE, "rank", "attempt") or not value.isdigit():
            raise ValueError(f"{FAULT_ENV}: cannot read '{item}' in '{spec}'")
        fields[key] = int(value)
    where = [w for w in WHERE if w in fields]
    if len(where) != 1:
        raise ValueError(f"{FAULT_ENV}: give exactly one of step=N or save=N in '{spec}'")
    return Fault(where[0], fields[where[0]], fields.get("rank", 0), fields.get("attempt", 0))


def fault_from_env(attempt: int) -> Fault | None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    fault = parse_fault(spec)
    return fault if fault.attempt == attempt else None


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class FaultInjection(pl.Callback):
    """Kills this process at the configured point (see the module docstring)."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.rank: int | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.rank = trainer.global_rank

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if self.fault.where == "step" and trainer.global_step == self.fault.step and self.rank == self.fault.rank:
            die()

    def before_publish(self, step: int) -> None:
        """Hooked into StepCheckpoint between writing a checkpoint and renaming it."""
        if self.fault.where == "save" and step == self.fault.step and self.rank == self.fault.rank:
            die()
