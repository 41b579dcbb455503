"""Megatron-style tensor parallelism for Hugging Face models, from the model's own ``base_model_tp_plan``.

Llama-family configs (Llama, Mistral, Qwen2, ...) state which projections are column-wise (q/k/v, gate/up) and
which row-wise (o, down): each rank keeps whole heads and one slice of the MLP, one all-reduce per sub-layer in
forward and one in backward. Only the plain ``colwise`` / ``rowwise`` styles are applied; a plan with any other
style is refused before launch. Around that plan, the rest follows the reference transformer's plan
(``tensor_parallel.py``) on the Llama module names: the token embedding is vocab-parallel (row-wise over the
vocabulary) and the LM head column-wise over it, its logits left sharded for ``loss_parallel``; a tied head is
the embedding's DTensor again.

Sequence parallelism shards the hidden states between the sub-layers along the sequence: the RMSNorms
(``input_layernorm``, ``post_attention_layernorm``, the final ``norm``) run on a ``1/tp`` slice, ``self_attn``
and ``mlp`` all-gather it at their input and their row-wise output projections reduce-scatter back to it. What
transformers computes outside the layers stays whole: the embedding output is replicated, so the model's forward
derives the positions, the causal mask and RoPE's ``(cos, sin)`` from the full sequence and passes them into
every layer unchanged; each stage's first layer takes its own slice of the hidden states (no communication), and
attention, which gets the gathered sequence, applies RoPE to it with its local heads. A later pipeline stage
receives the ``1/tp`` slices and all-gathers them before the model's forward (``gather_sequence``), for the same
reason.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from disttrain.config.hf import hf_shape, load_hf_config, sequence_parallel_problem
from disttrain.config.schema import HFModelConfig

SUPPORTED_STYLES = ("colwise", "rowwise")


def hf_tp_plan(config: object) -> dict[str, str] | None:
    """The architecture's own tensor-parallel plan (module pattern under the base model -> style), if any."""
    plan = getattr(config, "base_model_tp_plan", None)
    return dict(plan) if plan else None


def unsupported_styles(plan: dict[str, str]) -> list[str]:
    return sorted({style for style in plan.values() if style not in SUPPORTED_STYLES})


def _inner(module: nn.Module) -> nn.Module:
    """A decoder layer without its activation-checkpointing wrapper (hooks go on the layer that runs)."""
    return getattr(module, "_checkpoint_wrapped_module", module)


def _layer_plan(sequence_parallel: bool) -> dict[str, object]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    if not sequence_parallel:
        return {}
    return {
        "input_layernorm": SequenceParallel(),
        "post_attention_layernorm": SequenceParallel(),
        # The layer calls self_attn(hidden_states=..., position_embeddings=(cos, sin), ...): gather only the
        # hidden states; RoPE's tables already cover the whole sequence.
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        ),
        "mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    }


def apply_hf_tensor_parallel(
    wrapper: nn.Module, tp_mesh: object, plan: dict[str, str], sequence_parallel: bool, loss_parallel: bool
) -> int:
    """Shard ``wrapper.hf`` (a whole model or one pipeline stage of it) over ``tp_mesh`` in place; returns how many
    projections of ``plan`` matched. ``loss_parallel`` leaves the logits sharded over the vocabulary (a DTensor)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    hf = wrapper.hf  # type: ignore[attr-defined]
    base = getattr(hf, hf.base_model_prefix)
    if sequence_parallel and (problem := sequence_parallel_problem(hf)) is not None:
        raise ValueError(f"sequence parallelism needs the Llama layer layout: {problem}")
    between = Shard(1) if sequence_parallel else Replicate()
    styles = {"colwise": ColwiseParallel, "rowwise": lambda: RowwiseParallel(output_layouts=between)}
    # Concrete module paths: checkpoint wrappers add a segment that the plan's patterns do not know about.
    names = {name.replace("._checkpoint_wrapped_module", ""): name for name, _ in base.named_modules()}
    layout: dict[str, object] = {}
    for pattern, style in plan.items():
        for clean, real in names.items():
            if fnmatch.fnmatchcase(clean, pattern) and "." in clean:
                layout[real] = styles[style]()
    matched = len(layout)
    embedding = base.embed_tokens if isinstance(base.embed_tokens, nn.Embedding) else None
    head = hf.lm_head if isinstance(getattr(hf, "lm_head", None), nn.Linear) else None
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    for key, layer in base.layers.named_children():
        prefix = f"layers.{key}" + ("._checkpoint_wrapped_module" if layer is not _inner(layer) else "")
        for part, part_style in _layer_plan(sequence_parallel).items():
            layout[f"{prefix}.{part}"] = part_style
    if embedding is not None:
        layout["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if sequence_parallel and not isinstance(base.norm, nn.Identity):
        # A local slice out: the causal LM slices the hidden states (logits_to_keep) before its head.
        layout["norm"] = SequenceParallel(use_local_output=True)
    if layout:
        parallelize_module(base, tp_mesh, layout)
    if sequence_parallel and len(base.layers):
        # The stage's first layer takes its slice of the whole-sequence hidden states (backward: all-gather).
        parallelize_module(
            _inner(next(iter(base.layers))),
            tp_mesh,
            PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True),
        )
    if head is not None:
        parallelize_module(
            hf,
            tp_mesh,
            {
                "lm_head": ColwiseParallel(
                    input_layouts=between,
                    output_layouts=Shard(-1) if loss_parallel else Replicate(),
                    use_local_output=not loss_parallel,
                )
            },
        )
        if tied and embedding is not None:
            # Both layers shard the (vocab, hidden) weight on dim 0: share the embedding's DTensor again.
            hf.lm_head.weight = embedding.weight
    if sequence_parallel:
        wrapper.sequence_mesh = tp_mesh  # type: ignore[attr-defined]
    return matched


def gather_sequence(hidden: torch.Tensor, tp_mesh: object) -> torch.Tensor:
    """The whole sequence from this rank's ``1/tp`` slice along dim 1 (all-gather; backward: this rank's slice of
    the gradient, which the next layer's slice-taking makes identical on every tp rank)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    sharded = DTensor.from_local(hidden, tp_mesh, [Shard(1)], run_check=False)
    return sharded.redistribute(tp_mesh, [Replicate()]).to_local()


def hf_tp_probe_parts(
    cfg: HFModelConfig, tp_mesh: object, loss_parallel: bool, device: torch.device
) -> dict[str, object]:
    """The run's HF model (at the parts probe's two decoder layers), plain and under its own TP plan with the run's
    loss_parallel, for the start-up probe of tensor parallelism's host cost
    (``calibrate_parallel.tp_model_overhead``): its decoder layers are timed inside the whole model's
    passes (their family-specific arguments only the model passes them), the rest of a pass is the edges. Without
    sequence parallelism, as the reference transformer's probe (``tensor_parallel.tp_probe_parts``)."""
    from disttrain.models.probe_parts import hf_probe_model

    plain = hf_probe_model(cfg, torch.float32, device)
    parallel = hf_probe_model(cfg, torch.float32, device)
    matched = apply_hf_tensor_parallel(parallel, tp_mesh, hf_tp_plan(load_hf_config(cfg)) or {}, False, loss_parallel)
    modules = matched // max(1, len(parallel.blocks))
    shape = hf_shape(cfg)
    return {
        "model": (plain, parallel),
        "layers": (plain.blocks, parallel.blocks),
        "modules_per_block": modules,
        # Without SP each row-parallel projection all-reduces its output in forward, each column-parallel one its
        # input gradient in backward: one activation-sized collective per parallel projection.
        "collectives_per_block": modules,
        "d_model": shape.d_model,
        "vocab_size": shape.vocab_size,
        "seq_len": cfg.seq_len,
        "loss_parallel": loss_parallel,
    }
