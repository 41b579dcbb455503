"""Non-finite loss or gradients: detected in the step they appear, before the optimizer applies them.

Every micro-batch's loss is checked as it enters backward, every gradient before the optimizer step (and
before clipping, which would spread a NaN to every parameter). The verdict is all-reduced (max) so every rank
agrees: under FSDP a rank sees only its own gradient shard, and ranks that disagreed would diverge or hang.

On a bad step every gradient is dropped (``grad = None``): torch optimizers skip parameters without a
gradient, so the weights, the moments and Adam's step count stay exactly as they were. The step still counts
(its batch is consumed, the learning-rate schedule advances), as with a skipped step of an fp16 loss scaler.
``nan_policy=stop`` then stops the run (no checkpoint is written for the bad step, so the last one is the last
good one); ``skip`` carries on, up to ``max_nan_skips`` times.

Under ``fp16-mixed`` a loss scaler is at work: its first steps overflow by design (it starts at 2^16 and halves
its scale at each overflow, skipping that update itself), so an overflowing gradient with a finite loss is left
to it and counted (``scaler_skipped_steps``), not called a fault. Only a run of ``MAX_SCALER_OVERFLOWS`` in a
row, by then a scale no real gradient overflows at, is a non-finite fault under ``nan_policy``.

On a GPU the verdict is not read in the step it is voted (a host read there is a device sync: the host could not
queue the next step while the device finishes this one, and every step would expose the loop's own host time).
Where the optimizer is torch's fused AdamW (the GPU default, models/module.py) and no loss scaler owns the skip,
the guard hands the vote to the optimizer as its ``found_inf`` flag, so a bad step's update is skipped on the
device (weights, moments and step counts untouched, as with dropped gradients), and reads the verdict one step
later from a pinned copy, when it is long complete. The bookkeeping (skip count, stop, the riders' verdicts) then
comes one step late: a stop also skips that next step's update, so the weights are still the last good step's.
Before a checkpoint is written and when training ends the pending verdict is read at once (``settle``). One
difference: a gradient norm that overflowed its dtype with finite elements (which the step's own read tells
apart) is skipped as non-finite instead of clipped to zero.

Where the guard clips, the global gradient norm (before clipping) rides in the same vote as a third value, so the
user's logger gets it on the host with the verdict (a step late where the verdict is), never through a read of its
own: ``last_grad_norm``. Every rank holds the same global norm, so the vote's maximum is that norm.

A stop is agreed by every rank, but a spawned rank may finish its part and exit before the launcher has finished
its own: it writes ``stopping_rank<N>.json`` before it exits with code 4, and the launcher takes such an exit
for the agreed stop, not for a death (``agreed_stop``), and completes the stop itself (run.json, the report).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import lightning.pytorch as pl
import torch

from disttrain.launch.env import say_once
from disttrain.launch.exit_codes import NONFINITE

STOP_MARKER = "stopping_rank{rank}.json"
# 2^16 (GradScaler's start) halved 30 times is 2^-14: an fp16 gradient still overflowing there is not a scale search.
MAX_SCALER_OVERFLOWS = 30


def stop_marker(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / STOP_MARKER.format(rank=rank)


def write_stop_marker(run_dir: Path, rank: int, reason: str | None) -> None:
    """Written by a rank that ends with the agreed non-finite stop, before it exits (write, then rename)."""
    path = stop_marker(run_dir, rank)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"rank": rank, "exit_code": NONFINITE, "reason": reason}) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def agreed_stop(run_dir: Path, rank: int, code: int) -> bool:
    """Whether a rank's exit is the agreed non-finite stop (its exit code and its marker), not a death."""
    return code == NONFINITE and stop_marker(run_dir, rank).is_file()


def retire_stop_markers(run_dir: Path) -> None:
    """A restart or a re-run in the same run dir: an earlier attempt's markers must not excuse this one's exits."""
    for path in Path(run_dir).glob(STOP_MARKER.format(rank="*")):
        with contextlib.suppress(OSError):
            path.unlink()


def local_tensor(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient (FSDP2 gradients are DTensors sharded over ranks)."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


def exactly_nonfinite(grads: list[torch.Tensor]) -> bool:
    """The element-wise check, for when the gradients' norm came out non-finite (a NaN/inf element, or a sum of
    squares that overflowed their dtype).

    The norm is one fused pass over all gradients (clipping computes it anyway): an ``isfinite`` tensor per
    parameter on every step had cost ~2% of a step of the default model; this pass runs only on the rare step
    whose norm is not finite, so a large but finite gradient is never called non-finite.
    """
    return bool(torch.stack([(~torch.isfinite(local_tensor(g))).any() for g in grads]).any())


def global_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients, as ``clip_grad_norm_`` computes it; over every shard where they are sharded.

    Sharded gradients (FSDP2 DTensors) give a norm reduced over the ranks once, held replicated, so the clip that
    reuses it needs no second reduction.
    """
    meshes = {id(mesh): mesh for mesh in (getattr(g, "device_mesh", None) for g in grads)}
    if len(meshes) > 1:
        return _norm_over_meshes(grads, list(meshes.values()))
    norm = torch.nn.utils.get_total_norm(grads)
    full_tensor = getattr(norm, "full_tensor", None)
    if not callable(full_tensor):
        return norm
    from torch.distributed.tensor import DTensor, Replicate

    mesh = norm.device_mesh  # type: ignore[attr-defined]
    return DTensor.from_local(full_tensor(), mesh, [Replicate()] * mesh.ndim, run_check=False)


def _norm_over_meshes(grads: list[torch.Tensor], meshes: list[object]) -> torch.Tensor:
    """The global norm where gradients live on several meshes (expert parallelism: dense parameters sharded over
    every rank, experts over ``world / ep`` ranks). A mesh smaller than the world holds parameters that the ranks
    outside it hold other ones of (other experts): its squared norm, the same on each of its ranks, is summed over
    the world divided by its size. Returned as a plain replicated scalar, which scales DTensors of any mesh."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    squares = []
    for mesh in meshes:
        norm = torch.nn.utils.get_total_norm([g for g in grads if getattr(g, "device_mesh", None) is mesh])
        full_tensor = getattr(norm, "full_tensor", None)
        square = (full_tensor() if callable(full_tensor) else norm).square()
        size = mesh.size() if mesh is not None else 1  # type: ignore[attr-defined]
        if size < world:
            square = square / size
            torch.distributed.all_reduce(square)
        squares.append(square)
    return torch.stack(squares).sum().sqrt()


def clip_with_norm(params: list[torch.Tensor], max_norm: float | None, norm: torch.Tensor) -> None:
    """``clip_grads_with_norm_`` per device mesh: one foreach multiply cannot mix DTensors of two meshes. Nothing
    without a ``max_norm`` (no clipping configured)."""
    if max_norm is None:
        return
    by_mesh: dict[int, list[torch.Tensor]] = {}
    for param in params:
        by_mesh.setdefault(id(getattr(param, "device_mesh", None)), []).append(param)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)


def cast_vote(flags: list[torch.Tensor]) -> torch.Tensor:
    """Each flag's maximum over the ranks (true on any rank, for booleans), left on the device: one all-reduce."""
    verdict = torch.stack([flag.reshape(()) for flag in flags]).to(torch.float32)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MAX)
    return verdict


def vote(flags: list[torch.Tensor]) -> list[float]:
    """``cast_vote`` read on the host (on a GPU, a device sync)."""
    return cast_vote(flags).tolist()


@dataclass
class PendingVerdict:
    """A step's vote on its way to the host: read (``verdict``) once the device has produced it."""

    step: int
    host: torch.Tensor  # pinned on a GPU: the copy runs behind the step's work instead of waiting for it
    ready: Any  # a CUDA event recorded after the copy, or None where the copy was synchronous

    @classmethod
    def start(cls, step: int, verdict: torch.Tensor) -> PendingVerdict:
        if verdict.device.type != "cuda":
            return cls(step, verdict.detach().clone(), None)
        host = torch.empty(verdict.shape, dtype=verdict.dtype, pin_memory=True)
        host.copy_(verdict, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(step, host, event)

    def verdict(self) -> list[float]:
        if self.ready is not None:
            self.ready.synchronize()  # waits for this step's vote only, not for the work queued since
        return self.host.tolist()


def host_flags_to(device: torch.device, flags: list[float]) -> torch.Tensor:
    """Host values as one tensor on ``device``. To a GPU through pinned memory: a copy from pageable memory waits for
    every kernel queued before it (a device sync per step, which the deferred verdict exists to avoid)."""
    values = torch.tensor(flags, dtype=torch.float32)
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def defers_verdict(optimizer: Any, device: torch.device, scaler_enabled: bool) -> bool:
    """Whether the guard can skip a bad step on the device and read its verdict a step late: on a GPU, with an
    optimizer that honours ``found_inf`` (torch's fused Adam/AdamW), plain (not DTensor) parameters, and no loss
    scaler (an fp16 GradScaler sets ``found_inf`` itself)."""
    if device.type != "cuda" or scaler_enabled or not getattr(optimizer, "defaults", {}).get("fused"):
        return False
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return all(type(p) is torch.nn.Parameter for p in params)


class VoteRider(Protocol):
    """A per-step flag that rides in the guard's vote instead of a collective of its own (reliability/sigterm.py)."""

    def flag(self, trainer: pl.Trainer) -> float: ...

    def agreed(self, trainer: pl.Trainer, highest: float) -> None: ...


class NonFiniteGuard(pl.Callback):
    """The non-finite check of every optimizer step; with ``clip_norm``, also the gradient clipping.

    Clipping needs the gradients' global norm, and so does the check: computed once here, it serves both (the
    Trainer is then given no ``gradient_clip_val``). The clip is ``clip_grad_norm_``'s own arithmetic over the
    optimizer's parameters in their order, so the weights are bitwise those Lightning's clipping gives.
    """

    def __init__(
        self, policy: str, max_skips: int, record: Callable[..., None] | None = None, clip_norm: float | None = None
    ) -> None:
        self.policy = policy
        self.max_skips = max_skips
        self.record = record  # diagnostics telemetry writer of this rank, when diagnostics are on
        self.clip_norm = clip_norm or None
        self.skipped_steps: list[int] = []
        self.scaler_skipped_steps: list[int] = []  # fp16 overflows the loss scaler skipped (see module doc)
        self._scaler_overflows_in_a_row = 0
        self.stopped_at: int | None = None
        self.stop_reason: str | None = None
        self._bad_loss: torch.Tensor | None = None
        self.riders: list[VoteRider] = []  # the same on every rank: the vote's length must agree
        # None: decided at the first optimizer step (defers_verdict); tests force True/False.
        self.defer: bool | None = None
        self._pending: PendingVerdict | None = None
        self._trainer: pl.Trainer | None = None
        # (step, global gradient norm before clipping) of the newest verdict read; None where the guard does not
        # clip (its norm would be this rank's shard or stage only) or before the first read.
        self.last_grad_norm: tuple[int, float] | None = None

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        # Kept as a tensor: no host sync per micro-batch, one per optimizer step below.
        bad = (~torch.isfinite(local_tensor(loss.detach()))).any()  # vocab-parallel losses are DTensors
        self._bad_loss = bad if self._bad_loss is None else self._bad_loss | bad

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        device = trainer.strategy.root_device
        self._trainer = trainer
        if self.defer is None:
            self.defer = defers_verdict(optimizer, device, self._scaler(trainer) is not None)
        stop_now = self.settle(trainer) if self.defer else False
        norm: torch.Tensor | None = None
        if self.clip_norm is not None:
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            grads = [p.grad for p in params]
            norm = global_norm(grads) if grads else None
        else:
            grads = [local_tensor(p.grad) for p in pl_module.parameters() if p.grad is not None]
        # The norm's finiteness rides in the vote as a tensor: one host read per step (a device sync on a GPU),
        # not one for the norm and another for the vote. A non-finite norm is rare and decided exactly below.
        check = norm if norm is not None else (torch.nn.utils.get_total_norm(grads) if grads else None)
        norm_bad = (~torch.isfinite(local_tensor(check))).any() if check is not None else torch.tensor(False)
        bad_loss = self._bad_loss if self._bad_loss is not None else torch.tensor(False)
        self._bad_loss = None
        # The riders' host flags cross to the device as one tensor: one copy per step, not one per rider.
        riders = host_flags_to(device, [rider.flag(trainer) for rider in self.riders]).unbind()
        # No norm is -1: the vote's length agrees on every rank whatever it holds.
        norm_value = local_tensor(norm.detach()) if norm is not None else torch.full((), -1.0, device=device)
        verdict = cast_vote([bad_loss.to(device), norm_bad.to(device), norm_value.to(device), *riders])
        if self.defer:
            # Skipped on the device when the vote says so (or when the previous step's verdict stopped the run).
            found = torch.ones((), device=device) if stop_now else verdict[:2].max()
            optimizer.found_inf = found.to(torch.float32)
            if norm is not None:  # a non-finite norm makes the clipped gradients NaN: that update is skipped anyway
                clip_with_norm(params, self.clip_norm, norm)
            self._pending = PendingVerdict.start(trainer.global_step, verdict)
            return
        loss_vote, norm_vote, norm_value, *verdicts = verdict.tolist()
        self._keep_norm(trainer.global_step, norm_value)
        for rider, highest in zip(self.riders, verdicts, strict=True):
            rider.agreed(trainer, highest)
        loss_bad, norm_nonfinite = bool(loss_vote), bool(norm_vote)
        # Every rank saw the same vote, so all of them take this second (exact, rare) vote together: a non-finite
        # norm with finite elements is a sum of squares that overflowed the gradients' dtype, not a fault.
        grad_bad = norm_nonfinite and bool(vote([torch.tensor(exactly_nonfinite(grads), device=device)])[0])
        if not (loss_bad or grad_bad):
            self._scaler_overflows_in_a_row = 0
            if norm is not None:
                clip_with_norm(params, self.clip_norm, norm)
            return
        if not loss_bad and self._loss_scaler_overflow(trainer):
            return
        for param in pl_module.parameters():
            param.grad = None  # the optimizer skips parameters without gradients: no update, no moment change
        self._handle(trainer, trainer.global_step, self._what(loss_bad, grad_bad))

    def settle(self, trainer: pl.Trainer | None = None) -> bool:
        """Read a deferred verdict now and act on it (riders, skip count, stop); True if it stopped the run.

        Called at the next step, before a checkpoint is written and at the end of training; a no-op when nothing
        is pending (the verdict was read in its own step, or already settled)."""
        pending, self._pending = self._pending, None
        trainer = trainer or self._trainer
        if pending is None or trainer is None:
            return False
        loss_vote, norm_vote, norm_value, *verdicts = pending.verdict()
        self._keep_norm(pending.step, norm_value)
        for rider, highest in zip(self.riders, verdicts, strict=True):
            rider.agreed(trainer, highest)
        if self.stopped or not (loss_vote or norm_vote):
            return self.stopped  # after a stop, the step it skipped as well is not a second fault
        self._handle(trainer, pending.step, self._what(bool(loss_vote), bool(norm_vote)))
        return self.stopped

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.settle(trainer)

    def _keep_norm(self, step: int, value: float) -> None:
        if value >= 0 or value != value:  # a NaN norm is a fact worth logging; -1 means none was computed
            self.last_grad_norm = (step, value)

    @staticmethod
    def _what(loss_bad: bool, grad_bad: bool) -> str:
        return " and ".join(name for name, bad in (("loss", loss_bad), ("gradients", grad_bad)) if bad)

    @staticmethod
    def _scaler(trainer: pl.Trainer) -> Any:
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        return scaler if scaler is not None and scaler.is_enabled() else None

    def _loss_scaler_overflow(self, trainer: pl.Trainer) -> bool:
        """An fp16 overflow the loss scaler skips and recovers from by itself (it saw the same gradients in its
        ``unscale_``): left to it, unless it has gone on for ``MAX_SCALER_OVERFLOWS`` steps in a row."""
        if self._scaler(trainer) is None:
            return False
        self._scaler_overflows_in_a_row += 1
        if self._scaler_overflows_in_a_row >= MAX_SCALER_OVERFLOWS:
            return False
        self.scaler_skipped_steps.append(trainer.global_step)
        return True

    def _handle(self, trainer: pl.Trainer, step: int, what: str) -> None:
        if self.policy == "skip" and len(self.skipped_steps) < self.max_skips:
            self.skipped_steps.append(step)
            action = "skipped"
            message = (
                f"disttrain: non-finite {what} at step {step}: update skipped "
                f"({len(self.skipped_steps)} of at most {self.max_skips}, trainer.max_nan_skips)"
            )
        else:
            self.stopped_at = step
            action = "stopped"
            why = "nan_policy=stop" if self.policy == "stop" else f"more than trainer.max_nan_skips={self.max_skips}"
            self.stop_reason = f"non-finite {what} at step {step} ({why})"
            message = f"disttrain: {self.stop_reason}: stopping; the weights were not updated with it"
            trainer.should_stop = True
        if self.record is not None:
            with contextlib.suppress(Exception):  # telemetry is a record of the decision, never a reason to crash
                self.record("nonfinite", step=step, what=what, action=action, skipped_total=len(self.skipped_steps))
        say_once(message, file=sys.stderr)
