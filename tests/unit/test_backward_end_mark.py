"""The end of a rank's own backward compute is marked when autograd has computed the graph's last gradient, for any
model: issue 29's user model kept its position table as a root parameter, the old mark (a hook on the first
parameter's module output) fired at the logits' gradient, the start of backward, and every rank read as waiting."""

from __future__ import annotations

import time

import torch
from torch import nn

from diagnostics.collect.callback import DiagnosticsCallback


class RootParameterFirst(nn.Module):
    """A position table owned by the root and registered before the embedding: the first parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.zeros(8, 16))
        self.emb = nn.Embedding(32, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(tokens) + self.pos))


class SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)  # this rank's own work, late in backward
        return grad


def test_the_mark_falls_after_the_last_gradient_whatever_the_first_parameter_is() -> None:
    callback = DiagnosticsCallback.__new__(DiagnosticsCallback)  # only the timer and the hook are exercised
    callback.own_s = 0.0
    from diagnostics.collect.steps import PhaseTimer

    callback.timer = PhaseTimer()
    model = RootParameterFirst()
    last_grad: list[float] = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: last_grad.append(time.perf_counter()))
    tokens = torch.randint(0, 32, (2, 8))
    h = SlowBackward.apply(model.emb(tokens) + model.pos)
    loss = model.head(model.body(h)).sum()
    callback.timer.batch_start()
    callback.timer.before_backward()
    callback._mark_backward_compute_end(loss)
    start = time.perf_counter()
    loss.backward()
    callback.timer.after_backward()
    marked = callback.timer.current.backward_compute_s
    assert marked >= 0.05  # the slow part of backward is this rank's compute, not waiting
    assert start + marked >= max(last_grad) - 1e-3  # marked after every gradient was computed
