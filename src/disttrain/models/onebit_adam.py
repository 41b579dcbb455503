"""``optimizer=onebit_adam``: AdamW whose momentum, not gradients, crosses the wire after a warm-up, in 1 bit a value.

For ``freeze_steps`` optimizer steps it is AdamW over DDP's averaged gradients (decoupled weight decay, bias
correction). Then Adam's variance is frozen (its bias correction with it) and each step the rank's *local* gradient
goes into its momentum, which the exchange (``OneBitComm.average``, strategies/onebit.py) replaces with the
compressed average over ranks; the update is the usual ``m / (sqrt(v) + eps)``. The per-parameter state has AdamW's
names (``step``, ``exp_avg``, ``exp_avg_sq``), so a checkpoint moves between this and ``optimizer=adamw`` either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch


class MomentumExchange(Protocol):
    """What the optimizer needs of the exchange (``strategies/onebit.py``'s ``OneBitComm``, which DDP's comm hook
    reads too): the schedule, and the compressed average over ranks."""

    freeze_steps: int
    steps_done: int

    @property
    def compressing(self) -> bool: ...

    def average(self, flat: torch.Tensor) -> torch.Tensor: ...


class OneBitAdam(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        comm: MomentumExchange,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.comm = comm
        # The step count lives in each parameter's state; after a resume the hook must know it before the first
        # backward (does this step all-reduce gradients, or nothing?).
        self.register_load_state_dict_post_hook(lambda optimizer: optimizer._sync_schedule())

    def _sync_schedule(self) -> None:
        steps = [int(s["step"]) for s in self.state.values() if "step" in s]
        self.comm.steps_done = max(steps, default=0)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self.comm.steps_done + 1
        compressing = self.comm.compressing
        # Every trainable parameter takes part (a missing gradient is zero): the compressed exchange needs the same
        # buffer on every rank, whichever parameters a rank's batch happened to reach.
        groups = [(g, [p for p in g["params"] if p.requires_grad]) for g in self.param_groups]
        momenta = []
        # torch's foreach kernels: a few launches per group, not per parameter (a GPU step is otherwise launch-bound).
        for group, params in groups:
            if not params:
                continue
            beta1, beta2 = group["betas"]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            states = [self._state_of(p) for p in params]
            exp_avgs = [s["exp_avg"] for s in states]
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            if not compressing:
                exp_avg_sqs = [s["exp_avg_sq"] for s in states]
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
            momenta += exp_avgs
        if compressing:
            self._average_momentum(momenta)
            # A value whose gradient was zero through the whole warm-up (an embedding row of a token not yet seen)
            # has a frozen variance of 0, and compression hands it +-(its block's scale) of momentum every step:
            # divided by sqrt(0) + eps, that is an update of lr x scale / eps. Its momentum stays zero instead, as
            # DeepSpeed's exp_avg_mask had users do by hand: the variance's sign is that mask (1 where it is
            # positive, 0 where it is zero), in one foreach kernel per group rather than two kernels per parameter.
            variances = [self.state[p]["exp_avg_sq"] for _, params in groups for p in params]
            torch._foreach_mul_(momenta, torch._foreach_sign(variances))
        for group, params in groups:
            if not params:
                continue
            beta1, beta2 = group["betas"]
            states = [self.state[p] for p in params]
            # The variance stopped at freeze_steps, and its bias correction with it.
            correction1 = 1 - beta1**step
            correction2 = 1 - beta2 ** min(step, self.comm.freeze_steps)
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            denom = torch._foreach_div([s["exp_avg_sq"] for s in states], correction2)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_addcdiv_(params, [s["exp_avg"] for s in states], denom, value=-group["lr"] / correction1)
            torch._foreach_add_([s["step"] for s in states], 1)
        self.comm.steps_done = step
        return loss

    def _state_of(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _average_momentum(self, momenta: list[torch.Tensor]) -> None:
        flat = torch.cat([m.reshape(-1).float() for m in momenta])
        averaged = self.comm.average(flat).split([m.numel() for m in momenta])
        torch._foreach_copy_(momenta, [a.view_as(m) for a, m in zip(averaged, momenta, strict=True)])
