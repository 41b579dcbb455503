"""Each layout's compute and optimizer step composed from the run's own measured parts.

At start-up a run times one transformer block's forward and backward, the model's edges' (embedding, final norm,
LM head and the loss) and one optimizer step over a block's parameters, at its micro-batch, sequence length and
precision on its device (``diagnostics.collect.parts``). A layout's per-rank micro-batch is then

    forward  = blocks on the rank x block forward / tp  +  edges forward / tp
    backward = the same with the backward times (+ the forward again for the recomputed blocks)

where a pipeline rank holds ``n_layers / pp`` blocks and the slowest stage (the last: head and loss) sets the
pace, and tensor parallelism splits each part's math ``tp`` ways (its host overhead beyond that share is measured
separately: ``hw.tp_linear_overhead_us``). The optimizer step costs the measured seconds per parameter times the
parameters the rank steps (all of them under DDP, its shard under FSDP2/ZeRO, its stage's under PP). FSDP2's and
ZeRO's sharding does not change a rank's compute (the parameters are gathered whole).

A user's LightningModule is timed whole (its training step, backward and optimizer step: no blocks the planner
knows), and those parts stand in for that module only, scaled by samples to another micro-batch.

Parts measured on another model or workload (``calibration=RUN_DIR`` of a different run) are scaled by FLOPs:
each part's seconds per FLOP on that device class, times the planned part's FLOPs. That carries the device's
measured efficiency on the non-matmul work over, and is said in the basis (``scaled``) as the assumption it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from disttrain.planner.shapes import ModelShape
from disttrain.planner.spec import Layout, Workload

# Precision names the planner and the run use for the same autocast/parameter dtypes (fp8 is planned as bf16-mixed).
_SAME_PRECISION = {"fp8": "bf16-mixed"}


@dataclass(frozen=True)
class MeasuredParts:
    """Seconds of one micro-batch's parts on one device, and what they were measured at."""

    block_forward_s: float
    block_backward_s: float
    edges_forward_s: float
    edges_backward_s: float
    optimizer_step_s: float  # one step over ``block_numel`` parameters
    micro_batch: int
    seq_len: int
    d_model: int
    vocab_size: int
    block_numel: int
    precision: str
    # On a GPU, the allocator's bytes at the probe's micro-batch: what one block keeps from its forward for its
    # backward (with its output), and the edges' peak over forward and backward (logits, the loss, their gradients).
    block_activation_bytes: float | None = None
    edges_peak_bytes: float | None = None

    @classmethod
    def from_figures(cls, figures: Mapping[str, object] | None) -> MeasuredParts | None:
        """From ``Calibration.parts``; None when absent or incomplete (an older calibration file)."""
        if not figures:
            return None
        try:
            return cls(
                block_forward_s=float(figures["block_forward_s"]),  # type: ignore[arg-type]
                block_backward_s=float(figures["block_backward_s"]),  # type: ignore[arg-type]
                edges_forward_s=float(figures["edges_forward_s"]),  # type: ignore[arg-type]
                edges_backward_s=float(figures["edges_backward_s"]),  # type: ignore[arg-type]
                optimizer_step_s=float(figures["optimizer_step_s"]),  # type: ignore[arg-type]
                micro_batch=int(figures["micro_batch"]),  # type: ignore[call-overload]
                seq_len=int(figures["seq_len"]),  # type: ignore[call-overload]
                d_model=int(figures["d_model"]),  # type: ignore[call-overload]
                vocab_size=int(figures["vocab_size"]),  # type: ignore[call-overload]
                block_numel=int(figures["block_numel"]),  # type: ignore[call-overload]
                precision=str(figures["precision"]),
                block_activation_bytes=_optional_float(figures.get("block_activation_bytes")),
                edges_peak_bytes=_optional_float(figures.get("edges_peak_bytes")),
            )
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def whole_module(self) -> bool:
        """Timed as one piece (a user's LightningModule: disttrain.training.module_probe): no block, no edges of
        its own; its passes stand as the edges, its sample as the token."""
        return self.d_model == 0 and self.seq_len == 1 and self.block_forward_s == 0.0


def _optional_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


def measured_activations(
    parts: MeasuredParts | None, shape: ModelShape, workload: Workload
) -> tuple[float, float] | None:
    """(one block's kept bytes, the edges' peak bytes) at ``workload``'s micro-batch, from a GPU probe of this very
    model in this precision: scaled by tokens from the probe's micro-batch and sequence (linear in both under flash
    attention); None when the probe measured no memory (a CPU) or another model."""
    if parts is None or parts.block_activation_bytes is None or parts.edges_peak_bytes is None:
        return None
    if not precision_matches(parts, workload.precision) or not shape.known:
        return None
    if (parts.d_model, parts.vocab_size, parts.block_numel) != (
        shape.d_model,
        shape.vocab_size,
        shape.block_parameters,
    ):
        return None
    scale = workload.micro_batch_size * workload.seq_len / max(1, parts.tokens)
    return parts.block_activation_bytes * scale, parts.edges_peak_bytes * scale


@dataclass(frozen=True)
class PartsCompute:
    """One rank's micro-batch from measured parts, and its optimizer step."""

    forward_s: float
    backward_s: float
    optimizer_step_s: float
    basis: str  # measured (this model and micro-batch) | scaled (by FLOPs from another model or workload)


def block_flops_per_token(block_parameters: int, attention_width: int, seq_len: int) -> float:
    """One block's FLOPs per trained token: 6 per parameter plus the attention matmuls (12 x heads x head_dim x T,
    PaLM's count per layer)."""
    return 6.0 * block_parameters + 12.0 * attention_width * seq_len


def edges_flops_per_token(d_model: int, vocab_size: int) -> float:
    """The edges' FLOPs per trained token: the LM head's matmul (the embedding is a lookup)."""
    return 6.0 * d_model * vocab_size


def precision_matches(parts: MeasuredParts, precision: str) -> bool:
    return _SAME_PRECISION.get(parts.precision, parts.precision) == _SAME_PRECISION.get(precision, precision)


def parts_basis(parts: MeasuredParts | None, shape: ModelShape, workload: Workload) -> str | None:
    """``measured`` when the parts were timed on this model at this micro-batch and sequence length, ``scaled`` when
    on another (scaled by FLOPs), None when they cannot stand in (none, another precision, a raw parameter count)."""
    if parts is None or not precision_matches(parts, workload.precision):
        return None
    if shape.measured_module or parts.whole_module:
        if not (shape.measured_module and parts.whole_module and parts.block_numel == shape.num_parameters):
            return None  # a module's parts stand in for that module only: no formula carries them to another
        return "measured" if parts.micro_batch == workload.micro_batch_size else "scaled"
    if not shape.known:
        return None
    same = (
        parts.d_model == shape.d_model
        and parts.vocab_size == shape.vocab_size
        and parts.block_numel == shape.block_parameters
        and parts.micro_batch == workload.micro_batch_size
        and parts.seq_len == workload.seq_len
    )
    return "measured" if same else "scaled"


def _attention_width(shape: ModelShape) -> int:
    return shape.n_heads * shape.head_dim


def parts_compute(
    parts: MeasuredParts, shape: ModelShape, layout: Layout, workload: Workload, optimizer_parameters: int
) -> PartsCompute:
    """Forward and backward seconds of one micro-batch on the slowest rank of ``layout``, and its optimizer step
    over ``optimizer_parameters`` parameters (``step_time.gpu_optimizer_parameters``)."""
    basis = parts_basis(parts, shape, workload)
    if basis is None:
        raise ValueError("measured parts stand in only for a known shape at the precision they were measured in")
    optimizer = parts.optimizer_step_s / parts.block_numel * optimizer_parameters
    if parts.whole_module:
        # Another micro-batch scales the module's passes by its samples (the data-parallel layouts a module runs
        # under split no layer, so every rank runs the whole module on its rows).
        samples = workload.micro_batch_size / parts.micro_batch
        return PartsCompute(parts.edges_forward_s * samples, parts.edges_backward_s * samples, optimizer, basis)
    tokens = workload.micro_batch_size * workload.seq_len
    # The probe's block as the same formula sees it (its attention width is its d_model: the reference's heads).
    probe_block = parts.tokens * block_flops_per_token(parts.block_numel, parts.d_model, parts.seq_len)
    planned_block = tokens * block_flops_per_token(shape.block_parameters, _attention_width(shape), workload.seq_len)
    block_scale = planned_block / probe_block
    edges_scale = (tokens * edges_flops_per_token(shape.d_model, shape.vocab_size)) / (
        parts.tokens * edges_flops_per_token(parts.d_model, parts.vocab_size)
    )
    block_forward = parts.block_forward_s * block_scale / layout.tp
    block_backward = parts.block_backward_s * block_scale / layout.tp
    blocks = shape.n_layers / layout.pp  # all of a pipeline rank's virtual stages together
    recomputed = recompute_share(shape, workload.seq_len, layout.recompute)
    forward = blocks * block_forward + parts.edges_forward_s * edges_scale / layout.tp
    backward = blocks * (block_backward + recomputed * block_forward) + parts.edges_backward_s * edges_scale / layout.tp
    return PartsCompute(forward, backward, optimizer, basis)


def recompute_share(shape: ModelShape, seq_len: int, recompute: str) -> float:
    """Share of a block's forward that backward runs again: all of it under full recomputation, the attention core's
    FLOPs share of it under selective (Korthikanti et al. 2022), none without."""
    if recompute == "full":
        return 1.0
    if recompute == "selective":
        core = 4.0 * _attention_width(shape) * seq_len
        return core / (2.0 * shape.block_parameters + core)
    return 0.0
