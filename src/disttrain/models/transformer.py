"""The reference decoder-only transformer: one module tree for the GPT-2 and Llama families.

Behaviour comes only from ``ModelConfig`` fields (norm, mlp, pos_emb, bias, tie_embeddings, n_kv_heads), so
the same code and the same parameter names serve every preset, every strategy's parallelize plan and the
analytic accounting in ``disttrain.models.accounting``.

Names the parallelize plans rely on: ``tok_emb``, ``pos_emb``, ``blocks.<i>.attn.{wq,wk,wv,wo}``,
``blocks.<i>.mlp.{w1,w2[,w3]}``, ``norm``, ``lm_head``. Attention infers its local head count from the
projection output, so column-wise sharded ``wq/wk/wv`` (tensor parallel) work unchanged. A pipeline stage may
set ``tok_emb``, ``norm`` or ``lm_head`` to ``None``; ``forward`` then takes or returns hidden states.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.config.schema import MLPS, NORMS, POS_EMBS, ModelConfig
from disttrain.models.mlp import MLP
from disttrain.models.moe import GroupedExperts, MoE

# Prefixes inserted into parameter names by wrappers; stripped so init seeds depend on the model, not on
# which wrappers (activation checkpointing, torch.compile, FSDP1) were applied before init_weights.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _check_config(cfg: ModelConfig) -> None:
    if cfg.norm not in NORMS:
        raise ValueError(f"model.norm={cfg.norm!r}: expected one of {NORMS}")
    if cfg.mlp not in MLPS:
        raise ValueError(f"model.mlp={cfg.mlp!r}: expected one of {MLPS}")
    if cfg.pos_emb not in POS_EMBS:
        raise ValueError(f"model.pos_emb={cfg.pos_emb!r}: expected one of {POS_EMBS}")
    if cfg.d_model % cfg.n_heads:
        raise ValueError(f"model.d_model={cfg.d_model} is not divisible by model.n_heads={cfg.n_heads}")
    if cfg.n_heads % cfg.kv_heads:
        raise ValueError(f"model.n_heads={cfg.n_heads} is not divisible by model.n_kv_heads={cfg.kv_heads}")
    if cfg.pos_emb == "rope" and cfg.head_dim % 2:
        raise ValueError(f"rope needs an even head_dim, got d_model/n_heads={cfg.head_dim}")
    if cfg.is_moe and not 1 <= cfg.top_k <= cfg.num_experts:
        raise ValueError(f"model.top_k={cfg.top_k} must be in [1, model.num_experts={cfg.num_experts}]")


def build_norm(cfg: ModelConfig) -> nn.Module:
    """LayerNorm (bias iff ``cfg.bias``) or RMSNorm, both with ``cfg.norm_eps``."""
    if cfg.norm == "layernorm":
        return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
    return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)


def rope_cache(seq_len: int, head_dim: int, theta: float, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """cos and sin tables ``[seq_len, head_dim]`` in fp32 for the rotate-half form of RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, T, heads, head_dim]`` by position; ``cos``/``sin`` are ``[T, head_dim]``."""
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Causal self-attention with grouped-query support; separate q/k/v projections keep TP plans simple."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        # Megatron's selective recomputation: keep the projections' activations, recompute only the attention
        # core (QK^T, softmax, xV), whose saved state grows with seq^2 under non-flash kernels.
        self.recompute_core = False
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.bias)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=cfg.bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if cos is not None and sin is not None:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.recompute_core and torch.is_grad_enabled():
            y = torch.utils.checkpoint.checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            y = self.core(q, k, v)
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.resid_drop(self.wo(y))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over ``[B, heads, T, head_dim]`` tensors (the part selective recomputation redoes)."""
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=q.shape[1] != k.shape[1],
        )


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        # The layer's index in the full model; stays right when a pipeline stage keeps only some blocks.
        self.layer_id = layer_id
        self.norm1 = build_norm(cfg)
        self.attn = Attention(cfg)
        self.norm2 = build_norm(cfg)
        self.mlp: MLP | MoE = MoE(cfg) if cfg.is_moe else MLP(cfg)
        if isinstance(self.mlp, MoE):
            self.mlp.layer_id = layer_id  # what diagnostics name the layer by, on any pipeline stage

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """Decoder-only LM mapping token ids ``[B, T]`` to logits ``[B, T, vocab]``.

    The constructor leaves PyTorch's default init in place (or nothing, on the meta device); call
    ``init_weights(seed)`` (``build_model`` does) for the deterministic init every rank shares.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        _check_config(cfg)
        self.cfg = cfg
        self.tok_emb: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb: nn.Embedding | None = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.pos_emb == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks: nn.ModuleList | nn.ModuleDict = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        # Set by the tensor-parallel plan under sequence parallelism (see ``forward``).
        self.sequence_shards = 1
        self.norm: nn.Module | None = build_norm(cfg)
        self.lm_head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # Non-persistent: derived from the config, so checkpoints stay free of them and a meta-device model
        # gets real values from reset_rope_cache() (called by init_weights) after materialization.
        self.rope_cos: torch.Tensor | None
        self.rope_sin: torch.Tensor | None
        if cfg.pos_emb == "rope":
            cos, sin = rope_cache(cfg.seq_len, cfg.head_dim, cfg.rope_theta, device=self.tok_emb.weight.device)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            self.rope_cos = None
            self.rope_sin = None

    def tie_weights(self) -> None:
        """Share ``tok_emb.weight`` with ``lm_head`` iff ``cfg.tie_embeddings``.

        The constructor ties them; ``to_empty`` (materializing a meta model) replaces each module's parameters
        separately and so unties them, which is why ``init_weights`` (run by ``build_model``) calls this again.
        """
        head, embedding = self.lm_head, self.tok_emb
        if (
            self.cfg.tie_embeddings
            and head is not None
            and embedding is not None
            and head.weight is not embedding.weight
        ):
            head.weight = embedding.weight

    def reset_rope_cache(self) -> None:
        """Recompute the RoPE tables in fp32 on the buffers' current device (after ``to_empty`` or a cast)."""
        if self.rope_cos is None:
            return
        cos, sin = rope_cache(self.cfg.seq_len, self.cfg.head_dim, self.cfg.rope_theta, device=self.rope_cos.device)
        self.rope_cos, self.rope_sin = cos, sin

    def block_list(self) -> list[nn.Module]:
        """The blocks in layer order; a pipeline stage keeps them in a ModuleDict keyed by global layer id."""
        return list(self.blocks.values()) if isinstance(self.blocks, nn.ModuleDict) else list(self.blocks)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` for ``tokens [B, T]`` with ``T <= cfg.seq_len``.

        On a pipeline stage without ``tok_emb`` the input is hidden states ``[B, T, d_model]``; without
        ``lm_head`` the output is. Under sequence parallelism hidden states between stages hold this rank's
        ``1 / sequence_shards`` of the sequence.
        """
        seq = tokens.shape[1] if self.tok_emb is not None else tokens.shape[1] * self.sequence_shards
        if seq > self.cfg.seq_len:
            raise ValueError(f"sequence length {seq} exceeds model.seq_len={self.cfg.seq_len}")
        if self.tok_emb is not None:
            h = self.tok_emb(tokens)
            if self.pos_emb is not None:
                h = h + self.pos_emb(torch.arange(seq, device=tokens.device))
            h = self.drop(h)
        else:
            h = tokens
        cos = sin = None
        if self.rope_cos is not None and self.rope_sin is not None:
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for block in self.block_list():
            h = block(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return head_logits(self.lm_head, h) if self.lm_head is not None else h

    def _init_names(self) -> list[tuple[str, nn.Module]]:
        """Modules under canonical names: wrapper prefixes stripped, blocks named by their ``layer_id``."""
        named: list[tuple[str, nn.Module]] = []
        for name, child in self.named_children():
            if name == "blocks":
                for block in self.block_list():
                    named += [(f"blocks.{block.layer_id}.{n}".rstrip("."), m) for n, m in block.named_modules()]
            else:
                named += [(f"{name}.{n}".rstrip("."), m) for n, m in child.named_modules()]
        return [(canonical_name(n), m) for n, m in named]

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init from ``seed`` alone, without touching the global RNG.

        Linear and embedding weights ~ N(0, init_std), the residual output projections (``attn.wo``,
        ``mlp.w2``) ~ N(0, init_std / sqrt(2 * n_layers)) (GPT-2), biases 0, norm weights 1. Each tensor
        is drawn in fp32 on the CPU from a generator seeded with hash(seed, canonical parameter name), so a
        GPU rank, a CPU reference, a pipeline stage holding some blocks, and an FSDP2/TP model whose
        parameters are already DTensors all get bitwise the same values. Also recomputes the RoPE tables.
        """
        self.tie_weights()
        std = self.cfg.init_std
        residual_out = {id(m.wo) for m in self.modules() if isinstance(m, Attention)}
        residual_out |= {id(m.w2) for m in self.modules() if isinstance(m, MLP)}
        residual_scale = (2 * self.cfg.n_layers) ** -0.5
        seen: set[int] = set()
        for mod_name, module in self._init_names():
            for p_name, param in module.named_parameters(recurse=False):
                if id(param) in seen:  # the LM head tied to tok_emb is initialized once, as tok_emb
                    continue
                seen.add(id(param))
                if p_name == "bias":
                    value = torch.zeros(param.shape, dtype=torch.float32, device="cpu")
                elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                    value = torch.ones(param.shape, dtype=torch.float32, device="cpu")
                elif isinstance(module, GroupedExperts):
                    value = _expert_init(seed, f"{mod_name}.{p_name}", module, param, std, residual_scale)
                elif isinstance(module, (nn.Linear, nn.Embedding)):
                    scale = residual_scale if id(module) in residual_out else 1.0
                    name = f"{mod_name}.{p_name}"
                    if name == "lm_head.weight" and self.cfg.tie_embeddings:
                        # A last pipeline stage holds its own copy of the tied weight: start it equal to tok_emb.
                        name = "tok_emb.weight"
                    gen = torch.Generator().manual_seed(_param_seed(seed, name))
                    value = torch.empty(param.shape, dtype=torch.float32, device="cpu").normal_(
                        0.0, std * scale, generator=gen
                    )
                else:
                    raise TypeError(f"init_weights has no rule for {type(module).__name__}.{p_name}")
                _assign(param, value)
        self.reset_rope_cache()


# GEMM kernels on GPUs want every leading dimension a multiple of 16 bytes; an odd vocabulary (GPT-2's 50257) gets
# the unaligned fallback kernels. Measured on an H200 (benchmarks/gpu_suite.py, 16k tokens x 768): the LM head's
# forward+backward took 26.4 ms at 50257 rows and 7.2 ms padded to 50304, 31% of gpt2-124m's whole step.
HEAD_ROW_MULTIPLE = 64


def head_logits(head: nn.Linear, h: torch.Tensor) -> torch.Tensor:
    """``head(h)``, with the weight padded to a multiple of ``HEAD_ROW_MULTIPLE`` rows for the GEMM on a GPU.

    The padding is zeros, added per call and sliced off the logits: parameters, checkpoints and the loss are those
    of the unpadded head (nanoGPT pads the vocabulary itself, which changes all three). A plain weight only: a
    tensor-parallel head (DTensor shards) and fp8/quantized heads keep their own layer.
    """
    weight = head.weight
    rows = weight.shape[0]
    pad = -rows % HEAD_ROW_MULTIPLE
    if not pad or weight.device.type != "cuda" or type(weight) is not nn.Parameter or type(head) is not nn.Linear:
        return head(h)
    logits = F.linear(h, F.pad(weight, (0, 0, 0, pad)), None if head.bias is None else F.pad(head.bias, (0, pad)))
    return logits[..., :rows]


def canonical_name(name: str) -> str:
    """A parameter or module name without the parts wrappers insert (``_orig_mod.``, ...)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "").replace(prefix.rstrip("."), "")
    return name.replace("..", ".").strip(".")


def _expert_init(
    seed: int, name: str, experts: GroupedExperts, param: torch.Tensor, std: float, residual_scale: float
) -> torch.Tensor:
    """Each expert drawn from its own seed (name + global expert id): a rank holding experts ``[offset, ...)`` (or
    those ``ids`` under a placement) under expert parallelism draws exactly the values the whole model has there.
    ``w2`` is a residual output."""
    scale = residual_scale if name.endswith(".w2") else 1.0
    ids = experts.ids or range(experts.offset, experts.offset + param.shape[0])
    rows = []
    for j in range(param.shape[0]):
        gen = torch.Generator().manual_seed(_param_seed(seed, f"{name}.{ids[j]}"))
        rows.append(torch.empty(param.shape[1:], dtype=torch.float32).normal_(0.0, std * scale, generator=gen))
    return torch.stack(rows)


def _param_seed(seed: int, name: str) -> int:
    # hashlib, not hash(): Python's string hash is salted per process and would differ between ranks.
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a full-size CPU tensor into ``param``, which may live on any device or be a sharded DTensor."""
    if param.is_meta:
        return
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full value, so each slices its shard without comm.
        value = distribute_tensor(
            value.to(param.device, param.dtype), param.device_mesh, param.placements, src_data_rank=None
        )
        param.to_local().copy_(value.to_local())
    else:
        param.copy_(value)


def build_model(cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> Transformer:
    """Build the transformer on ``device`` with ``init_weights(seed)``; on ``"meta"`` leave it uninitialized.

    The model is constructed on the meta device first, so PyTorch's default init neither runs (it is
    overwritten anyway and slow for large presets) nor consumes the global RNG.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    model.init_weights(seed)  # also re-ties the embeddings that to_empty untied
    return model


def apply_activation_checkpointing(model: Transformer) -> None:
    """Wrap every block so its activations are recomputed in backward (non-reentrant checkpointing).

    Blocks are replaced in place inside ``model.blocks``, so ``fully_shard`` can be applied per block
    afterwards; state_dict keys are unchanged because ``checkpoint_wrapper`` strips its own prefix.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    own = getattr(model, "apply_activation_checkpointing", None)
    if callable(own):  # a wrapped third-party model (model=hf) knows where its layers live
        own()
        return
    keys = list(model.blocks.keys()) if isinstance(model.blocks, nn.ModuleDict) else range(len(model.blocks))
    for key in keys:
        block = model.blocks[key]
        if isinstance(block, Block):  # already-wrapped blocks are left alone, so applying twice is harmless
            model.blocks[key] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
