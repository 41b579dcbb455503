"""The Hugging Face config of a ``model=hf`` run, and the reference-transformer shape the planner reads from it.

Planner, MFU and the memory check work on ``ModelConfig`` shapes; ``hf_shape`` states an HF config in those
terms (layers, hidden, heads, kv heads, ffn, vocab, tied embeddings, norm, MLP, positions), so
``python -m plan model=hf model.path=...`` works like any preset. Only the config is read, never the weights.
``transformers`` is imported lazily: it costs seconds, and only HF runs should pay them.
"""

from __future__ import annotations

import json
from collections.abc import Container
from pathlib import Path
from typing import Any

from disttrain.config.errors import ConfigError
from disttrain.config.hf_source import check_source, read_source
from disttrain.config.schema import HFModelConfig, ModelConfig

# Architectures whose MLP is gate * up -> down (three matrices) rather than up -> down: SiLU-activated MLPs and the
# RMSNorm families (Llama, Mistral, Qwen, Gemma) are gated; GPT-2 style (LayerNorm + GELU) are not.
GATED_MLP_ACTIVATIONS = ("silu", "swish")


def check_hf_source(model: HFModelConfig) -> None:
    """Exactly one of ``path`` / ``config``, and the path a local model directory."""
    check_source(model.path, model.config)


def check_hf_weights(model: HFModelConfig) -> None:
    """``model.path`` holds safetensors weights for every parameter of the model its config.json describes, each at
    its shape. FSDP2 and ZeRO-3 ranks receive them tensor by tensor from rank 0's read, which has no fallback: a
    missing or misshapen tensor is refused here, before launch, not by a rank that has already started."""
    if model.path is None:
        return
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    directory = Path(model.path).expanduser()
    index, single = directory / "model.safetensors.index.json", directory / "model.safetensors"
    if not index.is_file() and not single.is_file():
        raise ConfigError(
            "model.path",
            f"'{model.path}' has no model.safetensors (nor a model.safetensors.index.json of shards)",
            "write the model with save_pretrained (safetensors is its default format)",
        )
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [single.name]
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(directory / file), framework="pt") as handle:  # reads the header only
            shapes.update({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})  # noqa: SIM118
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(load_hf_config(model))
    params: dict[int, tuple[tuple[int, ...], list[str]]] = {}
    for name, param in meta.named_parameters(remove_duplicate=False):  # a tied head: one parameter, two names
        params.setdefault(id(param), (tuple(param.shape), []))[1].append(name)
    missing = [names[0] for shape, names in params.values() if not any(stored_shape(n, shapes) == shape for n in names)]
    if missing:
        first = missing[0]
        held = stored_shape(first, shapes)
        found = "absent" if held is None else f"shape {list(held)}"
        raise ConfigError(
            "model.path",
            f"'{model.path}' lacks {len(missing)} of the {len(params)} weights its config.json describes "
            f"({first}: {found}, expected {list(params[id(meta.get_parameter(first))][0])})",
            "point model.path at the directory save_pretrained wrote for this config.json",
        )


# A fused expert weight of transformers 5 (``<layer>.experts.gate_up_proj [E, 2h, d]``, ``down_proj [E, d, h]``) as
# checkpoints written before it (and most published MoE checkpoints) store it: one Linear per expert and
# projection, gate before up. Mixtral's block was ``block_sparse_moe``, now ``mlp``.
LEGACY_EXPERT_PARTS = {"gate_up_proj": (("w1", "w3"), ("gate_proj", "up_proj")), "down_proj": (("w2",), ("down_proj",))}


def legacy_name(name: str, stored: Container[str]) -> str | None:
    """The name a checkpoint holds the (non-expert) tensor ``name`` under: itself, or under Mixtral's old block name."""
    for candidate in (name, name.replace(".mlp.", ".block_sparse_moe.")):
        if candidate in stored:
            return candidate
    return None


def legacy_expert_sources(name: str, stored: Container[str]) -> list[list[str]] | None:
    """The per-expert tensors a checkpoint holds for the fused expert weight ``name``: per expert, the names whose
    tensors concatenated on dim 0 are that expert's slice (the experts stacked give the fused tensor); None when
    ``name`` is not a fused expert weight or ``stored`` has no per-expert form of it."""
    head, _, weight = name.rpartition(".experts.")
    if weight not in LEGACY_EXPERT_PARTS:
        return None
    prefixes = [head] + ([head.removesuffix(".mlp") + ".block_sparse_moe"] if head.endswith(".mlp") else [])
    for prefix in prefixes:
        for parts in LEGACY_EXPERT_PARTS[weight]:
            experts: list[list[str]] = []
            while all(f"{prefix}.experts.{len(experts)}.{part}.weight" in stored for part in parts):
                experts.append([f"{prefix}.experts.{len(experts)}.{part}.weight" for part in parts])
            if experts:
                return experts
    return None


def stored_shape(name: str, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """The shape the checkpoint holds ``name`` at, a fused expert weight assembled from its per-expert form."""
    held = legacy_name(name, shapes)
    if held is not None:
        return shapes[held]
    sources = legacy_expert_sources(name, shapes)
    if sources is None:
        return None
    first = [shapes[part] for part in sources[0]]
    return (len(sources), sum(shape[0] for shape in first), *first[0][1:])


def load_hf_config(model: HFModelConfig) -> Any:
    """The ``transformers.PretrainedConfig`` (cached per source)."""
    return read_source(model.path, model.config)


def _first(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def hf_shape(model: HFModelConfig) -> ModelConfig:
    """The HF model stated as a reference-transformer shape (for parameter/FLOP accounting and the planner)."""
    config = load_hf_config(model)
    hidden = int(_first(config, "hidden_size", "n_embd"))
    heads = int(_first(config, "num_attention_heads", "n_head"))
    kv_heads = _first(config, "num_key_value_heads", default=heads)
    activation = str(_first(config, "hidden_act", "activation_function", default="gelu"))
    gated = activation in GATED_MLP_ACTIVATIONS or hasattr(config, "rms_norm_eps")
    # A model whose head_dim x heads != hidden (some Gemma/Qwen3 sizes) still trains; the reference shape has
    # head_dim = hidden / heads, so the planner's attention sizes are approximate for it (a run's own parameter
    # count is always the real model's).
    rope = hasattr(config, "rope_theta") or getattr(config, "rope_parameters", None) is not None
    rope_params = getattr(config, "rope_parameters", None) or {}
    return ModelConfig(
        name=model.name,
        family=str(config.model_type),
        n_layers=int(_first(config, "num_hidden_layers", "n_layer")),
        d_model=hidden,
        n_heads=heads,
        n_kv_heads=None if int(kv_heads) == heads else int(kv_heads),
        ffn_hidden=int(_first(config, "intermediate_size", "n_inner", default=4 * hidden)),
        vocab_size=int(config.vocab_size),
        seq_len=model.seq_len,
        norm="rmsnorm" if hasattr(config, "rms_norm_eps") else "layernorm",
        mlp="swiglu" if gated else "gelu",
        pos_emb="rope" if rope else "learned",
        rope_theta=float(_first(config, "rope_theta", default=rope_params.get("rope_theta", 10000.0))),
        bias=bool(_first(config, "attention_bias", "mlp_bias", default=not hasattr(config, "rms_norm_eps"))),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        init_std=float(model.init_std or _first(config, "initializer_range", default=0.02)),
        # A learned table (GPT-2) has a row per position the model supports, not per position a run uses.
        position_rows=None if rope else _first(config, "n_positions", "max_position_embeddings"),
        **hf_moe_fields(config),
    )


def hf_moe_fields(config: Any) -> dict[str, Any]:
    """The reference shape's mixture-of-experts fields of an HF MoE config (Mixtral, Qwen2-MoE, OLMoE: routed
    experts, top-k, expert hidden size, shared experts, the balancing weight); nothing for a dense one.

    Approximations the shape cannot state: Qwen2-MoE's shared expert (one MLP of ``shared_expert_intermediate_size``)
    is counted as that size over the expert size shared experts, its sigmoid shared-expert gate (d weights per layer)
    not at all, and layers left dense (``mlp_only_layers``, ``decoder_sparse_step > 1``) as MoE layers."""
    experts = int(_first(config, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
    if experts <= 0:
        return {}
    expert_hidden = int(_first(config, "moe_intermediate_size", "intermediate_size"))
    shared = int(_first(config, "shared_expert_intermediate_size", default=0) or 0)
    return {
        "num_experts": experts,
        "top_k": int(_first(config, "num_experts_per_tok", "top_k", default=2)),
        "expert_ffn_hidden": expert_hidden,
        "num_shared_experts": round(shared / expert_hidden) if shared else 0,
        "router_gate": "softmax",
        # Mixtral always renormalises the top-k weights; Qwen2-MoE and OLMoE say so in norm_topk_prob.
        "router_norm_topk": bool(_first(config, "norm_topk_prob", default=config.model_type == "mixtral")),
        "aux_loss_coef": float(_first(config, "router_aux_loss_coef", default=0.0)),
        "z_loss_coef": 0.0,
    }


def max_positions(model: HFModelConfig) -> int | None:
    """The longest sequence the model's position table or RoPE setting is built for, if it says."""
    return _first(load_hf_config(model), "max_position_embeddings", "n_positions")


def reference_shape(model: object) -> ModelConfig | None:
    """The shape the planner and the accounting use: the reference model's own, an HF model's, or None (a user's
    ``_target_`` model, whose shape is unknown)."""
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, HFModelConfig):
        return hf_shape(model)
    return None


# A decoder layer sequence parallelism can plan: two RMSNorms around attention and MLP (the Llama layout). A layer
# with any other module holding weights (Gemma-2's extra norms, say) would run it on sequence slices with
# replicated weights whose gradients then differ between tp ranks: refused instead.
SP_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def sequence_parallel_problem(hf: Any) -> str | None:
    """Why sequence parallelism cannot be planned on this ``PreTrainedModel`` (whole or a pipeline stage), or None."""
    from torch import nn

    base = getattr(hf, getattr(hf, "base_model_prefix", ""), None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return f"{type(hf).__name__} has no decoder `layers`"
    first = next(iter(layers))
    layer = getattr(first, "_checkpoint_wrapped_module", first)
    missing = [part for part in SP_LAYER_PARTS if not isinstance(getattr(layer, part, None), nn.Module)]
    extra = [
        name
        for name, child in layer.named_children()
        if name not in SP_LAYER_PARTS and any(True for _ in child.parameters())
    ]
    if missing or extra:
        what = f"no {', '.join(missing)}" if missing else f"weights outside them in {', '.join(extra)}"
        return f"its decoder layer {type(layer).__name__} has {what} (the Llama layout {list(SP_LAYER_PARTS)})"
    if not isinstance(getattr(base, "norm", None), nn.Module):
        return f"{type(base).__name__} has no final `norm`"
    return None


def hf_sequence_parallel_problem(model: HFModelConfig) -> str | None:
    """``sequence_parallel_problem`` for the model of a run, read from a one-layer copy on the meta device (no
    memory, no weights read)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(load_hf_config(model))
    config.num_hidden_layers = 1
    with torch.device("meta"):  # the modules do not depend on the attention kernel; eager is always there
        hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return sequence_parallel_problem(hf)
