"""Bytes of training state one rank holds: parameters, gradients and optimizer states, counted by storage.

This is what the planner's model-state terms predict, and it is measurable on any device (on CPU the peak RSS
also holds the Python/torch runtime, and activations come and go within a step). Each storage counts once (a
flat buffer with views into it, a tied weight); DTensors count their local shard; optimizers that wrap another
(DeepSpeed's ZeRO) are walked one level into their tensor attributes, which includes their communication buckets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class _Counter:
    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()
        self.total = 0

    def add(self, value: Any) -> None:
        if hasattr(value, "to_local") and callable(value.to_local):  # DTensor: this rank's shard
            value = value.to_local()
        if not isinstance(value, torch.Tensor) or value.device.type == "meta":
            return
        storage = value.untyped_storage()
        key = (str(value.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.total += storage.nbytes()

    def add_all(self, values: Iterable[Any]) -> None:
        for value in values:
            self.add(value)


def _tensors_of(obj: Any) -> Iterable[Any]:
    """Tensors in an optimizer's attributes: direct, or in a list/tuple/dict one level down."""
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, list | tuple):
            yield from (v for v in value if isinstance(v, torch.Tensor))
            for v in value:
                if isinstance(v, list | tuple):
                    yield from (t for t in v if isinstance(t, torch.Tensor))
        elif isinstance(value, dict):
            yield from (v for v in value.values() if isinstance(v, torch.Tensor))


def training_state_bytes(module: torch.nn.Module, optimizers: Iterable[Any]) -> int:
    counter = _Counter()
    for p in module.parameters():
        counter.add(p)
        counter.add(p.grad)
        counter.add(getattr(p, "ds_tensor", None))  # ZeRO-3's partition of this parameter
    for optimizer in optimizers:
        inner = optimizer
        while inner is not None:
            for state in getattr(inner, "state", {}).values():
                if isinstance(state, dict):
                    counter.add_all(state.values())
            for group in getattr(inner, "param_groups", []):
                counter.add_all(group.get("params", []))
            if inner is not optimizer or not isinstance(inner, torch.optim.Optimizer):
                counter.add_all(_tensors_of(inner))
            inner = getattr(inner, "optimizer", None)
    return counter.total
