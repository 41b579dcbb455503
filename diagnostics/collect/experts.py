"""Expert load counters of a mixture-of-experts model: tokens per expert per layer per step, and dropped ones.

The MoE layers count on the device as they route (models/moe.py); here they are read once per optimizer step (one
small device-to-host copy per layer) into this rank's telemetry. Found by duck typing (``take_counts``), so the
collectors stay independent of the model code. The layout record says which experts this rank computes and what
an expert costs per token, which is what the ``expert_imbalance`` analysis turns load into time with.

The layers' own collectives (expert parallelism's all-to-alls, the balancing loss's all-reduce) are timed as
FSDP2's are (collect/fsdp_comm): a rank that waits for the rank holding the hot experts waits inside them, in
forward or backward, where the wait would otherwise look like its own work.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import nn


def expert_layers(model: nn.Module) -> list[Any]:
    """The model's MoE layers in layer order (modules with ``take_counts``); empty for a dense model."""
    return [m for m in model.modules() if callable(getattr(m, "take_counts", None))]


def expert_layout(layers: list[Any]) -> dict[str, Any]:
    """Static facts: experts, top-k, the ep degree, this rank's experts and the routed FLOPs per token."""
    first = layers[0]
    weights = first.expert_weights()
    # Parameters of one expert (stacked weights [E_local, ...]: the shape of a DTensor is its global one).
    per_expert = sum(math.prod(w.shape[1:]) for w in weights)
    return {
        "layers": len(layers),
        # Each layer's index in the whole model (a pipeline stage holds some of them), where the layer knows it.
        "layer_ids": [i if getattr(m, "layer_id", None) is None else m.layer_id for i, m in enumerate(layers)],
        "num_experts": first.num_experts,
        "top_k": first.top_k,
        # Ranks splitting the experts: by all-to-all under EP, or the tp ranks (which hold the same tokens and sum
        # their experts' outputs) under strategy=megatron; the busiest paces the group either way.
        "ep": getattr(first, "expert_ranks", first.ep_size),
        "first_expert": first.first_expert,
        "num_local": first.num_local,
        # Per layer, which expert each slot holds (strategy.expert_placement; the group's k-th rank holds slots
        # [k E / ep, ...)); null for a layer whose slot is its expert id.
        "placement": [getattr(m, "placement", None) for m in layers],
        "capacity_factor": first.capacity_factor,
        "aux_loss_coef": getattr(first, "aux_loss_setting", first.aux_loss_coef),
        # The overrides that set them (an HF model's balancing weight is in its own config; it has no capacity).
        "aux_loss_key": first.balance_key,
        "capacity_key": first.capacity_key,
        # Training FLOPs (6 per parameter) of the routed experts for one token, over all layers.
        "routed_flops_per_token": 6.0 * first.top_k * per_expert * len(layers),
    }


def take_expert_load(layers: list[Any]) -> dict[str, list[list[int]]]:
    """This step's routed and dropped assignments per layer and expert (from this rank's tokens), counters reset."""
    taken = [layer.take_counts() for layer in layers]
    return {"routed": [routed for routed, _ in taken], "dropped": [dropped for _, dropped in taken]}


def time_expert_collectives(layers: list[Any], report: Callable[[str, float], None]) -> int:
    """Make every MoE layer tell ``report`` (op, seconds) of each collective it issues; returns the layers that
    can (those with a ``comm_observer``; a user's MoE layer without one is left alone)."""
    observed = [layer for layer in layers if hasattr(layer, "comm_observer")]
    for layer in observed:
        layer.comm_observer = report
    return len(observed)


def exchanges_tokens(layers: list[Any]) -> bool:
    """Whether the layers dispatch tokens to other ranks by all-to-all (expert parallelism over more than one)."""
    return any(getattr(layer, "ep_size", 1) > 1 for layer in layers)
