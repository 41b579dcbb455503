"""Analytic parameter and FLOP counts of the reference transformer, from its config alone.

Pure functions: nothing is instantiated, so they work for 70B presets on a laptop and inside the planner.
``count_parameters`` is kept equal to the numel of ``Transformer(cfg)`` by the unit tests.
"""

from __future__ import annotations

from disttrain.config.schema import ModelConfig


def _norm_parameters(cfg: ModelConfig) -> int:
    # LayerNorm has weight (+ bias iff cfg.bias); RMSNorm has only a weight.
    has_bias = cfg.norm == "layernorm" and cfg.bias
    return cfg.d_model * (2 if has_bias else 1)


def _attention_parameters(cfg: ModelConfig) -> int:
    q_dim = cfg.n_heads * cfg.head_dim
    kv_dim = cfg.kv_heads * cfg.head_dim
    weights = cfg.d_model * (q_dim + 2 * kv_dim) + q_dim * cfg.d_model
    biases = (q_dim + 2 * kv_dim + cfg.d_model) if cfg.bias else 0
    return weights + biases


def _dense_mlp_parameters(cfg: ModelConfig, hidden: int, bias: bool) -> int:
    n_in = 2 if cfg.mlp == "swiglu" else 1  # SwiGLU has two input projections (w1 gate, w3 up)
    weights = (n_in + 1) * cfg.d_model * hidden
    biases = (n_in * hidden + cfg.d_model) if bias else 0
    return weights + biases


def expert_parameters(cfg: ModelConfig) -> int:
    """One routed expert of an MoE layer (an MLP of ``expert_hidden``, no biases)."""
    return _dense_mlp_parameters(cfg, cfg.expert_hidden, bias=False)


def _mlp_parameters(cfg: ModelConfig, experts: int | None = None) -> int:
    """The FFN of one block; an MoE layer with ``experts`` routed experts (default all): router, experts, shared."""
    if not cfg.is_moe:
        return _dense_mlp_parameters(cfg, cfg.ffn_hidden, cfg.bias)
    shared = _dense_mlp_parameters(cfg, cfg.num_shared_experts * cfg.expert_hidden, cfg.bias)
    routed = cfg.num_experts if experts is None else experts
    return cfg.d_model * cfg.num_experts + routed * expert_parameters(cfg) + (shared if cfg.num_shared_experts else 0)


def block_parameters(cfg: ModelConfig) -> int:
    """Parameters of one transformer block (two norms, attention, MLP or all of an MoE layer's experts)."""
    return 2 * _norm_parameters(cfg) + _attention_parameters(cfg) + _mlp_parameters(cfg)


def active_block_parameters(cfg: ModelConfig) -> int:
    """Parameters one token uses in a block: an MoE layer's router, its top_k experts and the shared ones."""
    return 2 * _norm_parameters(cfg) + _attention_parameters(cfg) + _mlp_parameters(cfg, cfg.top_k)


def count_embedding_parameters(cfg: ModelConfig) -> int:
    """Token embedding plus learned position embedding: the parameters that are looked up, not multiplied."""
    pos = cfg.learned_position_rows * cfg.d_model if cfg.pos_emb == "learned" else 0
    return cfg.vocab_size * cfg.d_model + pos


def count_parameters(cfg: ModelConfig) -> int:
    """Exact parameter count of ``Transformer(cfg)``, a tied LM head counted once."""
    lm_head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    return count_embedding_parameters(cfg) + cfg.n_layers * block_parameters(cfg) + _norm_parameters(cfg) + lm_head


def count_active_parameters(cfg: ModelConfig) -> int:
    """Parameters one token uses (``count_parameters`` for a dense model; top_k of the experts for MoE)."""
    return count_parameters(cfg) - cfg.n_layers * (block_parameters(cfg) - active_block_parameters(cfg))


def matmul_parameters(cfg: ModelConfig) -> int:
    """N' of the FLOPs formula: the parameters each token multiplies with (an MoE layer: only its active experts).

    All parameters minus the position embedding and the token-embedding lookup (a gather, no FLOPs). The LM
    head is a matmul, so its ``vocab * d_model`` matrix counts once whether it is tied to the token embedding
    (the shared matrix is then counted for its matmul use) or separate. Norm weights and biases are included
    (as in PaLM's and nanoGPT's "non-embedding" counts); they are a negligible share.
    """
    return cfg.n_layers * active_block_parameters(cfg) + _norm_parameters(cfg) + cfg.vocab_size * cfg.d_model


def _attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    # Training FLOPs of the QK^T and AV matmuls per token: 2 matmuls * 2 FLOPs/MAC * 3 (fwd + 2x bwd),
    # over the full (not causally halved) attention matrix, as PaLM counts it.
    return 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Model FLOPs per trained token (forward + backward): ``6 N' + 12 L H Q T`` (PaLM, appendix B).

    N' is ``matmul_parameters(cfg)``, L layers, H heads, Q head_dim, T the sequence length (default
    ``cfg.seq_len``). This is the numerator of MFU: it does not count recomputation.
    """
    t = cfg.seq_len if seq_len is None else seq_len
    return 6.0 * matmul_parameters(cfg) + _attention_flops_per_token(cfg, t)


def hardware_flops_per_token(
    cfg: ModelConfig, seq_len: int | None = None, activation_checkpointing: bool = False
) -> float:
    """FLOPs the hardware executes per trained token (the numerator of HFU).

    Without activation checkpointing this equals ``flops_per_token``. With full per-block checkpointing each
    block's forward runs twice, so the block part becomes ``8 N_blocks + 16 L H Q T`` (forward 2+4, recompute
    2+4, backward 4+8) while the final norm and LM head, which are not recomputed, stay at ``6 x``.
    """
    t = cfg.seq_len if seq_len is None else seq_len
    flops = flops_per_token(cfg, t)
    if activation_checkpointing:
        # One extra forward of every block: 2 FLOPs per block parameter plus the forward attention matmuls.
        flops += 2.0 * cfg.n_layers * active_block_parameters(cfg) + _attention_flops_per_token(cfg, t) / 3.0
    return flops
