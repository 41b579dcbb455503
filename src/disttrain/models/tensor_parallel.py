"""Megatron-style tensor-parallel plan for the reference transformer (DTensor, on the ``tp`` mesh axis).

Attention: q/k/v column-wise (each rank keeps whole heads), output projection row-wise. MLP: w1 (and w3)
column-wise, w2 row-wise: one all-reduce per sub-layer in forward and one in backward. The token embedding is
vocab-parallel (row-wise over the vocabulary) and the LM head column-wise over the vocabulary; with
``loss_parallel`` its logits stay sharded and the cross-entropy runs on the shards (``loss_parallel()``).

Sequence parallelism shards the activations between the sub-layers along the sequence: norms run on a
``1/tp`` slice, the column-wise inputs all-gather it and the row-wise outputs reduce-scatter back to it (same
bytes as the all-reduces, less activation memory). The embedding output stays replicated so a learned
position embedding can be added to it; the first block then takes its own slice (no communication).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from disttrain.config.schema import ModelConfig
from disttrain.models.moe import MoE
from disttrain.models.transformer import Block, Transformer, rope_cache


def block_plan(has_w3: bool, sequence_parallel: bool, moe: bool = False, shared: bool = False) -> dict[str, object]:
    """The per-block plan, keyed by sub-module path inside ``Block``. A mixture-of-experts layer's routed experts
    are not in it (they are split over the tp ranks instead: ``split_experts_over_tp``); its shared experts, one
    dense MLP (``shared``, ``has_w3`` then says whether it is gated), are tensor-parallel as a dense MLP is."""
    between = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, object] = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=between),
    }
    # The routed experts' output is summed over the group whole, so a shared MLP beside it returns a whole output.
    mlp = "mlp.shared" if moe else "mlp"
    if shared or not moe:
        plan[f"{mlp}.w1"] = ColwiseParallel()
        plan[f"{mlp}.w2"] = RowwiseParallel(output_layouts=Replicate() if moe else between)
        if has_w3:
            plan[f"{mlp}.w3"] = ColwiseParallel()
    if sequence_parallel:
        plan["norm1"] = SequenceParallel()
        plan["norm2"] = SequenceParallel()
        # Attention and MLP need the whole sequence: gather the sequence shards at their input.
        plan["attn"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None), use_local_output=True
        )
        plan["mlp"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return plan


def split_experts_over_tp(layer: MoE, tp_mesh: DeviceMesh) -> None:
    """Expert parallelism inside the tp group: each tp rank computes ``E / tp`` experts on all tokens (which every tp
    rank holds after attention) and the layer sums the outputs over the group. The stacked weights become DTensors
    sharded on dim 0, so names, global shapes, init, checkpoints and the gradient norm stay the one-process ones.
    The router is replicated; its gradient is whole on every rank (``CopyToGroup``)."""
    tp = tp_mesh.size()
    experts = layer.experts
    for name in ("w1", "w2", "w3"):
        weight = getattr(experts, name)
        if weight is not None:
            sharded = distribute_tensor(weight.detach(), tp_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=weight.requires_grad))
    layer.tp_group, layer.tp_size = tp_mesh.get_group(), tp
    layer.held_experts = layer.num_experts // tp
    layer.tp_offset = tp_mesh.get_local_rank() * layer.held_experts


def parallelize_block(block: Block, tp_mesh: DeviceMesh, sequence_parallel: bool) -> nn.Module:
    """One transformer block under the tensor-parallel plan (its experts split over the tp ranks if it has them)."""
    if isinstance(block.mlp, MoE):
        shared = block.mlp.shared
        gated = shared is not None and shared.w3 is not None
        parallelize_module(block, tp_mesh, block_plan(gated, sequence_parallel, moe=True, shared=shared is not None))
        split_experts_over_tp(block.mlp, tp_mesh)
    else:
        parallelize_module(block, tp_mesh, block_plan(block.mlp.w3 is not None, sequence_parallel))
    return block


def apply_tensor_parallel(
    model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool
) -> None:
    """Shard ``model`` (a whole model or one pipeline stage of it) over ``tp_mesh`` in place."""
    blocks = model.block_list()
    for block in blocks:
        parallelize_block(block, tp_mesh, sequence_parallel)
    top: dict[str, object] = {}
    if model.tok_emb is not None:
        top["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if sequence_parallel and blocks:
            # Slicing a replicated tensor along the sequence is local; its backward all-gathers.
            parallelize_module(
                blocks[0],
                tp_mesh,
                PrepareModuleInput(
                    input_layouts=(Replicate(), None, None),
                    desired_input_layouts=(Shard(1), None, None),
                    use_local_output=True,
                ),
            )
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.lm_head is not None:
        top["lm_head"] = ColwiseParallel(
            input_layouts=Shard(1) if sequence_parallel else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    tied = model.cfg.tie_embeddings and model.tok_emb is not None and model.lm_head is not None
    if top:
        parallelize_module(model, tp_mesh, top)
    if tied and model.lm_head is not None and model.tok_emb is not None:
        # Both layers shard the (vocab, d_model) weight on dim 0: share the embedding's DTensor again.
        model.lm_head.weight = model.tok_emb.weight
    if sequence_parallel:
        model.sequence_shards = tp_mesh.size()


def tp_probe_parts(cfg: ModelConfig, tp_mesh: DeviceMesh, loss_parallel: bool, device: torch.device) -> dict:
    """The run's own layers, plain and under this plan, for the start-up probe of tensor parallelism's host cost
    (``calibrate_parallel.tp_model_overhead``): one transformer block, and the model without blocks (the
    vocab-parallel embedding, the final norm, the LM head; the loss runs under ``loss_parallel`` as the engine's).
    Without sequence parallelism: the probe times its plan only (an SP run is timed on it too)."""

    def block() -> nn.Module:
        torch.manual_seed(0)
        return Block(cfg, 0).to(device)

    def edges() -> Transformer:
        torch.manual_seed(0)
        model = Transformer(dataclasses.replace(cfg, n_layers=1)).to(device)
        model.blocks = nn.ModuleList()
        return model

    plan = block_plan(cfg.mlp == "swiglu", sequence_parallel=False, moe=cfg.is_moe, shared=cfg.num_shared_experts > 0)
    parallel_block = parallelize_block(block(), tp_mesh, sequence_parallel=False)
    parallel_edges = edges()
    apply_tensor_parallel(parallel_edges, tp_mesh, sequence_parallel=False, loss_parallel=loss_parallel)
    modules = sum(isinstance(p, ColwiseParallel | RowwiseParallel) for p in plan.values())
    rope = rope_cache(cfg.seq_len, cfg.head_dim, cfg.rope_theta, device=device) if cfg.pos_emb == "rope" else None
    return {
        "block": (block(), parallel_block),
        "edges": (edges(), parallel_edges),
        "rope": rope,
        "modules_per_block": modules,
        # Without SP each row-parallel linear all-reduces its output in forward, each column-parallel one its
        # input gradient in backward: one activation-sized collective per parallel linear. An MoE layer split over
        # the tp ranks adds three (its output forward, its tokens' and gate weights' gradients backward).
        "collectives_per_block": modules + (3 if cfg.is_moe else 0),
        "d_model": cfg.d_model,
        "vocab_size": cfg.vocab_size,
        "seq_len": cfg.seq_len,
        "loss_parallel": loss_parallel,
    }
