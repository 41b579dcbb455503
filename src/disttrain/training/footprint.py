"""What a user's LightningModule holds while it trains, measured from the module itself on the meta device.

A planner that knows a transformer's shape can write its memory as formulas; for any other module the only honest
source is the module. Built on meta (``build_lightning_module(device="meta")``) nothing is allocated, so a CPU box
measures a module planned for GPUs it does not have:

- parameters and buffers: their bytes, each in its own dtype; gradients: one per trainable parameter;
- optimizer states: what the module's own ``configure_optimizers`` builds holds after one step taken on meta
  gradients (Adam's two moments, SGD's momentum buffer, nothing for plain SGD), in whichever form Lightning accepts
  (an optimizer, a list, a dict, optimizers with schedulers);
- activations: the bytes autograd saves for backward over one ``training_step`` on a batch shaped like the
  datamodule's first (its rows the planned micro-batch), each storage once; a parameter autograd saves (a linear's
  weight) is a parameter, not an activation, and is not counted again;
- FLOPs per sample: ``FlopCounterMode`` over the same forward and backward (matmuls and convolutions, as MFU counts).

A step that cannot run on meta (data-dependent control flow, ``.item()``) leaves the activations and FLOPs
unknown, with the reason (``ModuleFootprint.unmeasured``), and so does a datamodule that gives no batch; the
states are known as soon as the module builds. The batch is the datamodule's own, read on the host: only its
shapes and dtypes move to meta.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.flop_counter import FlopCounterMode

from disttrain.config.errors import ConfigError
from disttrain.config.schema import CustomDataConfig, LightningModuleConfig
from disttrain.data.samples import batch_rows
from disttrain.data.user_datamodule import datamodule_arguments
from disttrain.models.targets import resolve_target
from disttrain.models.user_module import build_lightning_module
from disttrain.planner.footprint import ModuleFootprint


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def to_meta(batch: Any) -> Any:
    """``batch`` with every tensor replaced by an empty meta tensor of its shape and dtype (any nesting)."""
    if isinstance(batch, torch.Tensor):
        return torch.empty(batch.shape, dtype=batch.dtype, device="meta")
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(
            batch, **{f.name: to_meta(getattr(batch, f.name)) for f in dataclasses.fields(batch)}
        )
    if isinstance(batch, Mapping):
        return type(batch)({key: to_meta(value) for key, value in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_meta(item) for item in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(to_meta(item) for item in batch)
    return batch


def optimizers_of(configured: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in any return value ``configure_optimizers`` may have (Lightning's forms)."""
    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, Mapping):
        return optimizers_of(configured.get("optimizer"))
    if isinstance(configured, list | tuple):
        if len(configured) == 2 and all(isinstance(part, list | tuple) for part in configured):
            return optimizers_of(configured[0])  # ([optimizers], [schedulers])
        return [opt for item in configured for opt in optimizers_of(item)]
    return []


def optimizer_state_bytes(module: pl.LightningModule) -> int:
    """Bytes of every optimizer's state after one step of the module's own optimizers on meta gradients."""
    optimizers = optimizers_of(module.configure_optimizers())
    if not optimizers:
        raise ValueError("configure_optimizers returned no optimizer")
    for param in module.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    seen: set[int] = set()
    total = 0
    for optimizer in optimizers:
        optimizer.step()
        for state in optimizer.state.values():
            for value in state.values():
                # Step counters are host scalars; only tensors on the parameters' device are the states.
                if isinstance(value, torch.Tensor) and value.device.type == "meta" and value.dim() > 0:
                    key = value.untyped_storage()._cdata
                    if key not in seen:
                        seen.add(key)
                        total += value.untyped_storage().nbytes()
    for param in module.parameters():
        param.grad = None
    return total


def first_batch(data: CustomDataConfig, micro_batch_size: int) -> Any:
    """The datamodule's first training batch, built as the run builds it (``batch_size`` the micro-batch); a
    datamodule that cannot give one is one line naming ``data._target_``."""
    cls = resolve_target(data.target, "data._target_")
    try:
        datamodule = cls(**datamodule_arguments(data, micro_batch_size, None))  # type: ignore[operator]
        datamodule.prepare_data()
        datamodule.setup("fit")
        return next(iter(datamodule.train_dataloader()))
    except Exception as err:  # the user's datamodule: its own error, named
        raise ConfigError(
            "data._target_",
            f"{data.target} gave no training batch: {type(err).__name__}: {err}",
            "give data the keys its constructor takes; its train_dataloader() must yield a batch on this machine",
        ) from None


@contextlib.contextmanager
def _no_logging(module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` outside a Trainer raises; the measured step's logging is not what is measured."""
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict


def saved_activation_bytes(module: pl.LightningModule, batch: Any) -> tuple[int, float]:
    """(bytes autograd saves over one training_step and its backward, FLOPs of both) on meta."""
    parameters = {p.untyped_storage()._cdata for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in parameters:
            saved[storage._cdata] = storage.nbytes()
        return tensor

    counter = FlopCounterMode(display=False)
    with _no_logging(module), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), counter:
        out = module.training_step(batch, 0)
        loss = out["loss"] if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise ValueError("training_step returned no loss tensor")
        loss.backward()
    for param in module.parameters():
        param.grad = None
    return sum(saved.values()), float(counter.get_total_flops())


def measure_footprint(
    model: LightningModuleConfig, data: CustomDataConfig | None, micro_batch_size: int
) -> ModuleFootprint:
    """The footprint of ``model`` trained on ``data`` at ``micro_batch_size`` rows (see the module docstring)."""
    module = build_lightning_module(model, device="meta")
    params = list(module.parameters())
    trainable = [p for p in params if p.requires_grad]
    unmeasured: list[str] = []
    try:
        states: int | None = optimizer_state_bytes(module)
    except Exception as err:  # a configure_optimizers that reads the Trainer, an optimizer without a meta step
        states = None
        unmeasured.append(f"optimizer states: {type(err).__name__}: {err}")
    activations: int | None = None
    rows: int | None = None
    flops: float | None = None
    if data is None:
        unmeasured.append("activations and FLOPs: no datamodule to take a batch from (data._target_)")
    else:
        batch = first_batch(data, micro_batch_size)  # a data._target_ that does not import: one line, not a note
        try:
            rows = batch_rows(batch)
            activations, total_flops = saved_activation_bytes(module, to_meta(batch))
            flops = total_flops / rows if rows and total_flops > 0 else None
        except Exception as err:  # data-dependent code on meta (.item(), control flow on values)
            activations, rows = None, None
            unmeasured.append(f"activations and FLOPs: {type(err).__name__}: {err}")
    return ModuleFootprint(
        num_parameters=sum(p.numel() for p in params),
        parameter_bytes=tensor_bytes(iter(params)),
        gradient_bytes=tensor_bytes(iter(trainable)),
        buffer_bytes=tensor_bytes(module.buffers()),
        optimizer_state_bytes=states,
        activation_bytes=activations,
        micro_batch_size=rows if activations is not None else None,
        flops_per_sample=flops,
        unmeasured=tuple(unmeasured),
    )
