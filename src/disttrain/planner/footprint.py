"""A user's module in training as the planner takes it: bytes of one replica and FLOPs per sample, measured from
the module (``training/footprint.py``), with the reason for each part that could not be."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.planner.shapes import ModelShape


@dataclass(frozen=True)
class ModuleFootprint:
    """Bytes of one replica of a module in training, and its FLOPs per sample; None where not measured."""

    num_parameters: int
    parameter_bytes: int
    gradient_bytes: int  # trainable parameters only
    buffer_bytes: int
    optimizer_state_bytes: int | None  # None: configure_optimizers or its step did not run on meta
    activation_bytes: int | None  # saved for backward at ``micro_batch_size`` rows
    micro_batch_size: int | None  # the rows of the measured batch
    flops_per_sample: float | None
    unmeasured: tuple[str, ...] = ()  # why a None above is None

    @property
    def optimizer_states_per_parameter_byte(self) -> float | None:
        """The optimizer's bytes per byte of trainable parameter (Adam 2, SGD with momentum 1, plain SGD 0)."""
        if self.optimizer_state_bytes is None or not self.gradient_bytes:
            return None
        return self.optimizer_state_bytes / self.gradient_bytes

    def activation_bytes_at(self, micro_batch_size: int) -> float | None:
        """Activations at another micro-batch: saved tensors grow with the rows of the batch."""
        if self.activation_bytes is None or not self.micro_batch_size:
            return None
        return self.activation_bytes * micro_batch_size / self.micro_batch_size


def footprint_shape(name: str, footprint: ModuleFootprint) -> ModelShape:
    """The planner's shape of a measured module: a parameter count without layers (no tensor or pipeline plan, no
    formula for activations), its optimizer's states, activations and FLOPs per sample as measured, and the sample
    as its unit of work (``seq_len`` 1). Unmeasured activations and FLOPs count as 0 (the plan's notes say so)."""
    states = footprint.optimizer_states_per_parameter_byte
    per_sample = footprint.activation_bytes_at(1)
    return ModelShape(
        name=name,
        num_parameters=footprint.num_parameters,
        seq_len=1,
        optimizer_states=2.0 if states is None else states,
        activation_bytes_per_sample=per_sample if per_sample is not None else 0.0,
        flops_per_sample=footprint.flops_per_sample or 0.0,
    )


def footprint_notes(footprint: ModuleFootprint) -> tuple[str, ...]:
    """What the plan of a measured module stands on, and what it could not measure."""
    notes = ["measured on meta from the module (parameters, its optimizer's states, saved activations, FLOPs)"]
    if footprint.optimizer_state_bytes is None:
        notes.append("optimizer states not measured: AdamW's two moments assumed")
    if footprint.flops_per_sample is None:
        notes.append("no matmul or convolution FLOPs counted: compute time is not predicted (0)")
    notes.extend(footprint.unmeasured)
    return tuple(notes)
