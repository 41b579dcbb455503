"""MFU and HFU arithmetic as pure functions of plain numbers (no torch, no config objects).

Model FLOPs per trained token follow PaLM (Chowdhery et al. 2022, appendix B): ``6N + 12·L·H·Q·T`` — 6 FLOPs
per matmul parameter (2 forward, 4 backward) plus the attention score and value matmuls over the full
sequence. MFU divides the model FLOPs the run achieved by the peak the devices could do; HFU counts the FLOPs
the hardware actually executed, recomputation included. A utilization above 1 is physically impossible, so it
is raised as an accounting error (wrong peak, wrong token count, wrong device count), never returned.
"""

from __future__ import annotations


class AccountingError(ValueError):
    """A FLOPs utilization above 100%: the numbers that produced it are wrong, not the hardware fast."""


def attention_flops_per_token(num_layers: int, num_heads: int, head_dim: int, seq_len: int) -> float:
    """``12·L·H·Q·T``: QKᵀ and AV, 2 FLOPs per MAC, forward plus twice that backward."""
    return 12.0 * num_layers * num_heads * head_dim * seq_len


def model_flops_per_token(num_params: float, num_layers: int, num_heads: int, head_dim: int, seq_len: int) -> float:
    """Model FLOPs per trained token, ``6N + 12·L·H·Q·T`` (the numerator of MFU)."""
    return 6.0 * num_params + attention_flops_per_token(num_layers, num_heads, head_dim, seq_len)


def hardware_flops_per_token(
    num_params: float,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    seq_len: int,
    recompute_fraction: float = 0.0,
) -> float:
    """FLOPs the hardware executes per token: model FLOPs plus the recomputed share of the forward pass.

    ``recompute_fraction`` is the fraction of the forward that runs twice (1.0 for full activation
    checkpointing): each recomputed forward adds ``2N + 4·L·H·Q·T``, a third of the training FLOPs.
    """
    if not 0.0 <= recompute_fraction <= 1.0:
        raise ValueError(f"recompute_fraction must be in [0, 1], got {recompute_fraction}")
    forward = 2.0 * num_params + attention_flops_per_token(num_layers, num_heads, head_dim, seq_len) / 3.0
    return model_flops_per_token(num_params, num_layers, num_heads, head_dim, seq_len) + recompute_fraction * forward


def checked_utilization(value: float, what: str = "MFU") -> float:
    """Return ``value`` if it is a possible utilization (0..1); raise AccountingError above 1."""
    if value != value or value < 0:  # NaN or negative: not a utilization at all
        raise AccountingError(f"{what} is {value!r}: the throughput or FLOPs accounting is broken")
    if value > 1.0:
        raise AccountingError(
            f"{what} would be {100 * value:.1f}% (> 100%): the peak FLOP/s, the device count or the FLOPs per "
            "token is wrong"
        )
    return value


def flops_utilization(
    tokens_per_s: float, flops_per_token: float, num_devices: int, peak_flops_per_device: float, what: str = "MFU"
) -> float:
    """Achieved FLOP/s over the peak of all devices, as a fraction (raises AccountingError above 1)."""
    if num_devices < 1 or peak_flops_per_device <= 0:
        raise ValueError(f"need num_devices >= 1 and a positive peak, got {num_devices} and {peak_flops_per_device}")
    return checked_utilization(tokens_per_s * flops_per_token / (num_devices * peak_flops_per_device), what)


def mfu(tokens_per_s: float, flops_per_token: float, num_devices: int, peak_flops_per_device: float) -> float:
    """Model FLOPs utilization; ``flops_per_token`` are model FLOPs (``model_flops_per_token``)."""
    return flops_utilization(tokens_per_s, flops_per_token, num_devices, peak_flops_per_device, "MFU")


def hfu(tokens_per_s: float, hardware_flops: float, num_devices: int, peak_flops_per_device: float) -> float:
    """Hardware FLOPs utilization; ``hardware_flops`` per token include recomputation."""
    return flops_utilization(tokens_per_s, hardware_flops, num_devices, peak_flops_per_device, "HFU")
