"""Deliberate failures for testing recovery: ``DISTTRAIN_FAULT=sigkill@step=7,rank=1``.

Recovery code is only trustworthy if it is exercised. A fault is ``KIND@WHERE=N[,rank=R][,attempt=A]``; several
are separated by ``;`` (faults that do not end the run, such as a skipped non-finite step, can share one run).

Kinds, and where they strike:

- ``sigkill@step=N``: SIGKILL (which nothing can catch or clean up after: what a machine failure or the OOM killer
  does) right after optimizer step N completed; ``sigkill@save=N``: during the checkpoint save of step N, after
  every rank wrote its part and before the checkpoint is renamed to its final name (what is on disk is then
  exactly what a kill mid-save leaves);
- ``raise@step=N``: a ``RuntimeError`` in the forward of step N (a bug in user code on one rank);
- ``nan_loss@step=N``: the model's output, so its loss and gradients, turn +inf in step N;
- ``nan_grad@step=N``: one gradient element turns +inf after the backward of step N (as autograd accumulates it,
  where the module runs backward itself), the loss stays finite;
- ``hang@step=N``: the forward of step N blocks forever outside any collective (the hang watchdog's case);
- ``enospc@save=N``: the checkpoint write of step N fails with ``OSError(ENOSPC)`` naming the file;
- ``hot_expert@step=N[,layer=L][,experts=K]``: from step N on, this rank's router of MoE layer L (default 0)
  favours experts 0..K-1 (default K=1; their logits raised by ``HOT_EXPERT_BIAS``; a transformers router, which
  chooses inside its forward, routes again from the raised logits): every token picks them, the
  load imbalance ``expert_imbalance`` reports (not a failure: the diagnosis benchmarks' injected skew). Under the
  contiguous expert-parallel placement, K hot experts up to ``E / ep`` all sit on the group's first rank.

Steps count from 1, as the step records and crash records number them (step N runs while ``global_step`` is
N-1; the non-finite guard's messages give that ``global_step``). ``rank=R`` is the global rank (default 0);
``attempt=A`` the restart attempt (default 0, so a restarted run does not fail again at the same point). Unset,
nothing here runs.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from disttrain.reliability.nan_guard import local_tensor

FAULT_ENV = "DISTTRAIN_FAULT"
WHERE = ("step", "save")
KINDS = {  # kind -> where it can strike
    "sigkill": WHERE,
    "raise": ("step",),
    "nan_loss": ("step",),
    "nan_grad": ("step",),
    "hang": ("step",),
    "enospc": ("save",),
    "hot_expert": ("step",),
}
HOT_EXPERT_BIAS = 10.0  # router logits of a fresh model are ~0.1: a bias of 10 wins every token's top-1


@dataclass(frozen=True)
class Fault:
    where: str  # step | save
    step: int
    rank: int = 0
    attempt: int = 0
    kind: str = "sigkill"
    layer: int = 0  # hot_expert only: the MoE layer whose router is skewed
    experts: int = 1  # hot_expert only: how many experts (0..experts-1) it favours


def parse_fault(spec: str) -> Fault:
    """``sigkill@step=7[,rank=1][,attempt=0]`` -> Fault (ValueError naming the problem otherwise)."""
    kind, _, args = spec.strip().partition("@")
    if kind not in KINDS:
        raise ValueError(f"{FAULT_ENV}: unknown fault '{kind}' (one of {', '.join(KINDS)})")
    fields: dict[str, int] = {}
    for item in filter(None, args.split(",")):
        key, _, value = item.partition("=")
        extra = ("layer", "experts") if kind == "hot_expert" else ()
        if key not in (*WHERE, "rank", "attempt", *extra) or not value.isdigit():
            raise ValueError(f"{FAULT_ENV}: cannot read '{item}' in '{spec}'")
        fields[key] = int(value)
    where = [w for w in WHERE if w in fields]
    if len(where) != 1:
        raise ValueError(f"{FAULT_ENV}: give exactly one of step=N or save=N in '{spec}'")
    if where[0] not in KINDS[kind]:
        raise ValueError(f"{FAULT_ENV}: {kind} strikes at {' or '.join(f'{w}=N' for w in KINDS[kind])}, in '{spec}'")
    return Fault(
        where[0],
        fields[where[0]],
        fields.get("rank", 0),
        fields.get("attempt", 0),
        kind,
        fields.get("layer", 0),
        fields.get("experts", 1),
    )


def faults_from_env(attempt: int) -> list[Fault]:
    """The faults of ``DISTTRAIN_FAULT`` (``;``-separated) meant for restart attempt ``attempt``."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return []
    return [fault for fault in map(parse_fault, filter(str.strip, spec.split(";"))) if fault.attempt == attempt]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def biased_routing(router: torch.nn.Module, output: Any, experts: int) -> Any:
    """``output`` of a router with experts ``0..experts-1`` favoured by ``HOT_EXPERT_BIAS`` on their logits: the
    logits themselves (built-in), or transformers' (logits, top-k weights, top-k indices) routed again from them as
    its router does (softmax, top-k, renormalised unless ``norm_topk_prob`` is false)."""
    logits = output[0] if isinstance(output, tuple) else output
    bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
    bias[:experts] = HOT_EXPERT_BIAS
    logits = logits + bias
    if not isinstance(output, tuple):
        return logits
    _, weights, chosen = output
    top, indices = torch.topk(torch.softmax(logits.float(), dim=-1), chosen.shape[-1], dim=-1)
    if getattr(router, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(weights.dtype), indices


class FaultInjection(pl.Callback):
    """Strikes this rank with its faults at the configured points (see the module docstring)."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults
        self.rank: int | None = None
        self.step = 0  # the step running now, counted from 1
        self.armed: set[str] = set()  # in-step faults of the running step that have not struck yet

    def mine(self, kind: str, where: str, step: int) -> bool:
        return any(f.kind == kind and f.where == where and f.step == step and f.rank == self.rank for f in self.faults)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.rank = trainer.global_rank

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mine = {f.kind for f in self.faults if f.rank == self.rank}
        for fault in (f for f in self.faults if f.kind == "hot_expert" and f.rank == self.rank):
            self._skew_router(pl_module, fault)
        if "nan_grad" in mine and not pl_module.automatic_optimization:
            # The module runs backward itself (Megatron's pipeline engine): no after-backward hook is called, so the
            # gradient turns non-finite as autograd accumulates it (later micro-batches add to an inf: it stays).
            for param in pl_module.parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(self._after_accumulate)
        if not mine & {"raise", "hang", "nan_loss"}:
            return
        # The model (Megatron: each pipeline chunk) as the strategy built it; the first one a step calls strikes.
        model = getattr(pl_module, "model", None) or pl_module
        for module in (model, *model.children()):
            module.register_forward_pre_hook(self._before_forward)
            module.register_forward_hook(self._after_forward)

    def _skew_router(self, pl_module: pl.LightningModule, fault: Fault) -> None:
        routers = [m.routing_module for m in pl_module.modules() if hasattr(m, "routing_module")]
        if fault.layer >= len(routers):
            raise ValueError(
                f"{FAULT_ENV}: hot_expert layer={fault.layer}, but the model has {len(routers)} MoE layers"
            )

        def favour_first_experts(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if not module.training or self.step < fault.step:
                return None
            return biased_routing(module, output, fault.experts)

        # Before the layer's own hooks (an HF layer reads the logits for its balancing loss from one).
        routers[fault.layer].register_forward_hook(favour_first_experts, prepend=True)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        step = trainer.global_step + 1
        if step != self.step:  # under gradient accumulation: the step's first micro-batch
            self.step = step
            self.armed = {k for k in ("raise", "hang", "nan_loss", "nan_grad") if self.mine(k, "step", step)}

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not module.training:
            return
        if "raise" in self.armed:
            self.armed.discard("raise")
            raise RuntimeError(f"exception in forward of step {self.step} on rank {self.rank} ({FAULT_ENV})")
        if "hang" in self.armed:
            threading.Event().wait()  # never set: this rank blocks outside any collective

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if module.training and "nan_loss" in self.armed and isinstance(output, torch.Tensor):
            self.armed.discard("nan_loss")
            return output + float("inf")
        return None

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for param in pl_module.parameters():
            self._after_accumulate(param)

    def _after_accumulate(self, param: torch.Tensor) -> None:
        if "nan_grad" not in self.armed or param.grad is None:
            return
        grad = local_tensor(param.grad)
        if grad.numel():  # an FSDP rank may hold an empty shard of a parameter
            grad.view(-1)[0] = float("inf")
            self.armed.discard("nan_grad")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if self.mine("sigkill", "step", trainer.global_step):
            die()

    def before_write(self, step: int, path: Path) -> None:
        """Hooked into StepCheckpoint just before it writes ``path``."""
        if self.mine("enospc", "save", step):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def before_publish(self, step: int) -> None:
        """Hooked into StepCheckpoint between writing a checkpoint and renaming it."""
        if self.mine("sigkill", "save", step):
            die()
