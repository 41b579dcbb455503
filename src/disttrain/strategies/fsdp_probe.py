"""The FSDP probe's model for a strategy=fsdp run (``calibrate_parallel.fsdp_model_overhead``): the run's
own model cut to a block or two (its edges kept), plain and wrapped in ``fully_shard`` as the run wraps it (a unit
per block, resharded after forward as the run's are, then the root), in the run's parameter dtype.

FSDP2's host work per unit on a CPU (its hooks, the copies into and out of its collective buffers, the DTensor
plumbing of every parameter, the math running beside the collectives' threads) measured 7-10 ms per block of the
run's models against 2-3 ms from a pair of Linear layers of the same bytes: it grows with what a block holds, not
only with its bytes, so it is measured on the run's own block. The planner charges it per byte copied
(``hw.fsdp_copy_ns_per_byte``), which this probe's copies are counted in, exactly as ``planner.comm`` counts a run's.
"""

from __future__ import annotations

import copy
from typing import TypeGuard

import torch
from torch.distributed.device_mesh import DeviceMesh

from disttrain.config.schema import HFModelConfig, ModelConfig, PrecisionConfig
from disttrain.config.strategy_schema import FSDPConfig
from disttrain.models.probe_parts import PRECISIONS, dense_known_model, small_model_copy

# Precisions whose FSDP2 units gather and compute in the dtype the parameters are held in (no mixed-precision
# policy): the plain twin then runs the same math, so the difference is FSDP2's alone.
SAME_DTYPE_PRECISIONS = ("fp32", "bf16-true")


def fsdp_probe_supported(
    model: object, fsdp: FSDPConfig, precision: PrecisionConfig, compiled: bool
) -> TypeGuard[ModelConfig | HFModelConfig]:
    """Whether the probe can build the run's model as the run shards it: the reference transformer or an HF model,
    dense, uncompiled, one expert-parallel group, parameters on the device, without a mixed-precision cast."""
    return (
        dense_known_model(model)
        and not compiled
        and fsdp.ep == 1
        and not fsdp.cpu_offload
        and not fsdp.activation_checkpointing
        and precision.name in SAME_DTYPE_PRECISIONS
    )


def fsdp_probe_parts(
    model: ModelConfig | HFModelConfig, fsdp: FSDPConfig, precision: str, mesh: DeviceMesh, device: torch.device
) -> dict[str, object]:
    """``plain`` and ``sharded`` (the same small model of the run's, tokens -> logits), ``vocab_size``, ``seq_len``,
    ``modules`` (the FSDP2 modules: its units and the root, each with its hooks) and ``copy_bytes``, what FSDP2 copies
    on the host per forward + backward: every parameter out of the all-gather buffer and its gradient into the
    reduce-scatter buffer, the blocks' parameters gathered again for backward when resharded after forward."""
    param_dtype, _ = PRECISIONS[precision]
    plain = small_model_copy(model, param_dtype, device)
    sharded = copy.deepcopy(plain)
    blocks = list(sharded.blocks)  # type: ignore[arg-type]
    for block in blocks:
        torch.distributed.fsdp.fully_shard(block, mesh=mesh, reshard_after_forward=fsdp.reshard_after_forward)
    torch.distributed.fsdp.fully_shard(sharded, mesh=mesh, reshard_after_forward=False)
    element = torch.empty((), dtype=param_dtype).element_size()
    numel = sum(p.numel() for p in plain.parameters())
    block_numel = sum(p.numel() for block in plain.blocks for p in block.parameters())  # type: ignore[union-attr]
    regathered = block_numel if fsdp.reshard_after_forward else 0
    return {
        "plain": plain,
        "sharded": sharded,
        "vocab_size": model.vocab_size,
        "seq_len": model.seq_len,
        "modules": len(blocks) + 1,
        "copy_bytes": element * (2 * numel + regathered),
    }
