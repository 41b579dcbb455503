"""A user's LightningModule as the parts probe's parts: its own ``training_step``, backward and optimizer step on a
copy, at the run's real micro-batch on the run's device (diagnostics.collect.parts times them).

The planner's step time for a module it only knows by its counted FLOPs misses everything that is not a matmul at
the device's peak (convolutions' layouts, elementwise work, autograd, the optimizer, Python): a conv-net classifier
on CPU was predicted at less than half its step. Timing the module itself carries all of it, as the built-in
models' block probe does. The copy keeps the run untouched: its weights, buffers (batch-norm statistics), gradients
and optimizer states are its own, and the trainer is cut out of it (``self.log`` off the trainer does nothing), so
nothing the probe runs reaches the run's logs or collectives. Not probed: a module that optimizes manually (its
``training_step`` steps itself), one holding compiled code (a copied compiled forward can still call the
original's), one whose ``training_step`` or ``configure_optimizers`` needs the trainer, and one whose copy would not
fit beside it.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from disttrain.training.flop_count import holds_compiled_code
from disttrain.training.footprint import optimizers_of

# A copy's parameters, gradients and two moments in fp32, on top of the run's own: probed only where this many
# bytes per parameter are free (a GPU's free memory; on a CPU, up to this many GiB of them).
COPY_BYTES_PER_PARAMETER = 16
CPU_COPY_LIMIT_BYTES = 2 * 1024**3


def room_for_copy(module: torch.nn.Module, device: torch.device) -> bool:
    needed = COPY_BYTES_PER_PARAMETER * sum(p.numel() for p in module.parameters())
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return needed < free / 2  # the run's activations still need theirs
    return needed <= CPU_COPY_LIMIT_BYTES


def module_parts(
    module: pl.LightningModule, batch: Any, step_context: Callable[[], contextlib.AbstractContextManager]
) -> dict | None:
    """``{"forward", "backward", "optimizer", "numel"}``: the module's training step on ``batch`` (returns its
    loss), that loss's backward, and its optimizers' step, all on a copy; None where it cannot be probed (module
    doc). One pass runs here, so a module that cannot run off the trainer is found now, not while timed."""
    if not module.automatic_optimization or holds_compiled_code(module):
        return None
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if not room_for_copy(module, device):
        return None
    trainer = module._trainer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            probe = copy.deepcopy(module, {id(trainer): None} if trainer is not None else {})
            probe.train()
            optimizers = optimizers_of(probe.configure_optimizers())
        except Exception:  # a module that cannot be copied or configured off its trainer
            return None
    if not optimizers:
        return None

    def forward() -> torch.Tensor:
        with warnings.catch_warnings(), step_context():
            warnings.simplefilter("ignore")
            out = probe.training_step(batch, 0)
        return out["loss"] if isinstance(out, Mapping) else out

    def backward(loss: torch.Tensor) -> None:
        loss.backward()

    def step() -> None:
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    try:
        loss = forward()
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            return None
        backward(loss)
        step()
    except Exception:  # e.g. a training_step reading self.trainer: not probed, the FLOPs stand
        return None
    return {
        "forward": forward,
        "backward": backward,
        "optimizer": step,
        "numel": sum(p.numel() for p in probe.parameters()),  # as the footprint counts them: the planner matches it
    }
