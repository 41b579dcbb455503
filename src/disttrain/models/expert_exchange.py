"""What moves tokens and gradients between the ranks of a mixture-of-experts layer: the all-to-all that sends each
token to the rank holding its expert and back (timed for the diagnostics), the regrouping of tokens by expert, and
the autograd functions that copy to, reduce over and attach the balancing loss across an expert-parallel group."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

# Reports the seconds of one collective an MoE layer issued: (op, seconds). Set by the diagnostics (a rank that
# waits for a slower peer waits inside these calls, in the phase that issued them; see diagnostics/collect).
CommObserver = Callable[[str, float], None]


def cumsum_exclusive(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(0) - x


def regroup(counts: torch.Tensor) -> torch.Tensor:
    """Gather indices turning rows laid out in ``counts``' row-major segments into column-major segment order.

    ``counts [a, b]``: segment (i, j) holds ``counts[i, j]`` consecutive rows. After an all-to-all the rows arrive
    ordered by (source rank, local expert); the experts want them by (local expert, source rank).
    """
    flat = counts.reshape(-1)
    starts = cumsum_exclusive(flat).view_as(counts).t().reshape(-1)
    sizes = counts.t().reshape(-1)
    total = int(flat.sum())
    return torch.arange(total, device=counts.device) + torch.repeat_interleave(starts - cumsum_exclusive(sizes), sizes)


# The op name of the token exchanges that end this rank's expert compute (combine forward, the dispatch's reverse in
# backward): a peer holding busier experts is waited for there. The other exchanges are "all_to_all".
ALL_TO_ALL_AFTER_EXPERTS = "all_to_all_after_experts"


def timed_collective(
    observer: CommObserver | None, op: str, collective: Callable[..., object], *args: object, **kw: object
) -> None:
    """``collective(*args, **kw)``, its seconds told to ``observer`` (when one is set)."""
    if observer is None:
        collective(*args, **kw)
        return
    start = time.perf_counter()
    try:
        collective(*args, **kw)
    finally:
        observer(op, time.perf_counter() - start)


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits, differentiable (backward is the reverse exchange), each exchange
    timed for ``observer`` (gloo and the host-synchronous backends block for the slowest rank inside the call)
    under the op names ``ops`` gives its forward and backward calls."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: object,
        observer: CommObserver | None,
        ops: tuple[str, str],
    ) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.observer = (out_splits, in_splits), group, observer  # type: ignore[attr-defined]
        ctx.backward_op = ops[1]  # type: ignore[attr-defined]
        return _exchange(x, out_splits, in_splits, group, observer, ops[0])

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits  # type: ignore[attr-defined]
        op = ctx.backward_op  # type: ignore[attr-defined]
        back = _exchange(grad, in_splits, out_splits, ctx.group, ctx.observer, op)  # type: ignore[attr-defined]
        return back, None, None, None, None, None


def _exchange(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: object,
    observer: CommObserver | None,
    op: str = "all_to_all",
) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    timed_collective(observer, op, dist.all_to_all_single, out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class CopyToGroup(torch.autograd.Function):
    """Identity forward, gradient all-reduced over ``group`` backward (Megatron's ``f``): a replicated input whose
    consumers on each rank see only part of the work (this rank's experts) gets the gradient of all of it."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, group: object, observer: CommObserver | None
    ) -> torch.Tensor:
        ctx.group, ctx.observer = group, observer  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        total = grad.contiguous().clone()
        timed_collective(ctx.observer, "all_reduce", dist.all_reduce, total, group=ctx.group)  # type: ignore[attr-defined]
        return total, None, None


class AttachAuxLoss(torch.autograd.Function):
    """Identity on a layer's output forward; backward also sends ``scale`` as the gradient of the layer's auxiliary
    loss (Megatron's MoEAuxLossAutoScaler). The loss then needs no path to the objective: a pipeline stage's
    backward, which starts from the activations' gradient, trains its layers' routers too."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, out: torch.Tensor, aux: torch.Tensor, scale: float
    ) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale  # type: ignore[attr-defined]
        return out.view_as(out)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad, torch.full_like(aux, ctx.scale), None  # type: ignore[attr-defined]


class ReduceFromGroup(torch.autograd.Function):
    """Sum over ``group`` forward, identity backward (Megatron's ``g``): each rank's experts' share of the output."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, group: object, observer: CommObserver | None
    ) -> torch.Tensor:
        total = x.contiguous().clone()
        timed_collective(observer, "all_reduce", dist.all_reduce, total, group=group)
        return total

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None
