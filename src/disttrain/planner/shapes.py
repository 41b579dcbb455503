"""The model as the planner sees it: its parameter tensors with shapes, from a ModelConfig or a raw count.

Derived from the config here rather than imported from ``disttrain.models``: that package's ``__init__``
imports the ``nn.Module`` code and so torch, and the planner must stay importable (and fast) without it. The
unit tests keep these counts equal to ``disttrain.models.count_parameters``/``matmul_parameters`` and to the
real model, and the per-rank FSDP2 shard equal to what ``fully_shard`` allocates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from disttrain.config.schema import ModelConfig

# How tensor parallelism (Megatron-style) splits a tensor: column-parallel (output dim 0), row-parallel
# (input dim 1), vocab-parallel (dim 0, Megatron pads the vocabulary to a multiple of tp), or replicated.
TP_SPLITS = ("col", "row", "vocab", "rep")
# What a tensor does per token: a matmul operand (Linear), a norm scale/shift, an embedding lookup (a
# gather, no FLOPs), the token embedding tied to the LM head (a lookup and a matmul), or the stacked weights of
# an MoE layer's routed experts (``[E, ...]``: a token multiplies with top_k / E of them).
KINDS = ("linear", "norm", "lookup", "tied", "expert")


@dataclass(frozen=True)
class ParamTensor:
    name: str  # inside its FSDP unit, e.g. "attn.wq.weight" in a block, "tok_emb.weight" in the root
    shape: tuple[int, ...]
    tp: str
    kind: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def in_flops(self) -> bool:
        """Counted in N' of 6N' (everything a token multiplies with, norms included as PaLM/nanoGPT count)."""
        return self.kind not in ("lookup", "expert")

    def tp_numel(self, tp: int, shards: int = 1) -> int:
        """Elements one tensor-parallel rank holds; with ``shards``, its FSDP2 dim-0 chunk of that slice."""
        shape = list(self.shape)
        if self.tp != "rep" and tp > 1:
            dim = 1 if self.tp == "row" else 0
            shape[dim] = math.ceil(shape[dim] / tp)
        return math.ceil(shape[0] / shards) * math.prod(shape[1:])

    def fsdp_numel(self, shards: int) -> int:
        """Elements FSDP2 allocates per rank: dim 0 chunked like ``torch.chunk``, every rank padded to chunk 0 (stacked
        expert weights with fewer experts than ranks: dim 1, see ``expert_shard_dim``)."""
        return fsdp_shard_numel(
            self.shape, shards, expert_shard_dim(self.shape, shards) if self.kind == "expert" else 0
        )


def expert_shard_dim(shape: tuple[int, ...], shards: int) -> int:
    """The dim FSDP2 shards a stacked expert weight ``[experts, ...]`` on over ``shards`` ranks: dim 0 (whole experts)
    unless there are fewer experts than ranks, where dim-0 chunks would leave every rank a whole expert's worth of
    padding (Mixtral's 8 experts on 64 ranks: 8x the even share); then dim 1 if it divides evenly (FSDP2 shards
    other dims only evenly)."""
    return 1 if shape[0] < shards and len(shape) > 1 and shape[1] % shards == 0 else 0


def fsdp_shard_numel(shape: tuple[int, ...], shards: int, dim: int = 0) -> int:
    """Elements of one rank's FSDP2 shard of a ``shape`` tensor sharded on ``dim`` (chunked, padded to chunk 0)."""
    return math.ceil(shape[dim] / shards) * (math.prod(shape) // shape[dim])


@dataclass(frozen=True)
class ModelShape:
    """Parameter tensors and the sizes activations and FLOPs depend on; ``n_layers == 0`` means a raw count."""

    name: str
    num_parameters: int
    n_layers: int = 0
    d_model: int = 0
    n_heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    ffn_hidden: int = 0
    vocab_size: int = 0
    seq_len: int = 0
    swiglu: bool = False
    norm_statistics: int = 0  # per-token fp32 values each norm saves: LayerNorm mean and rstd, RMSNorm rstd
    dropout: float = 0.0
    tied_embeddings: bool = False
    block: tuple[ParamTensor, ...] = ()  # one transformer block (an FSDP unit)
    embedding: tuple[ParamTensor, ...] = ()  # first pipeline stage: token (+ learned position) embedding
    head: tuple[ParamTensor, ...] = ()  # last pipeline stage: final norm (+ LM head when untied)
    num_experts: int = 0  # routed experts per MoE layer (0: dense)
    top_k: int = 0  # routed experts per token
    shared_experts: bool = False  # an MoE layer's shared experts (one dense MLP beside the routed ones)
    # Whether strategy=megatron can run this shape's MoE layers (the built-in model's; not transformers' blocks).
    megatron_experts: bool = True
    # The optimizer's state bytes per byte of parameter: AdamW's two moments, or what a measured module's own
    # optimizer holds (planner/footprint.py: SGD with momentum 1, plain SGD 0).
    optimizer_states: float = 2.0
    # A module measured as it is (``footprint_shape``): no layers to write formulas over; its unit of work is the
    # sample (``seq_len`` 1, so a "token" of the formulas is a sample), its activations and FLOPs per sample measured.
    activation_bytes_per_sample: float | None = None
    flops_per_sample: float | None = None

    @cached_property
    def expert_parameters(self) -> int:
        """Routed-expert parameters of one block (all experts; 0 for a dense model)."""
        return sum(t.numel for t in self.block if t.kind == "expert")

    @cached_property
    def active_block_parameters(self) -> int:
        """Parameters one token uses in a block: all but the routed experts it is not sent to."""
        if not self.num_experts:
            return self.block_parameters
        return self.block_parameters - self.expert_parameters + self.expert_parameters * self.top_k // self.num_experts

    @property
    def measured_module(self) -> bool:
        """A module measured as it is (planner/footprint.py): its unit of work is the sample."""
        return self.activation_bytes_per_sample is not None

    @property
    def unit(self) -> str:
        """What a "token" of the formulas is: a token, or a measured module's sample."""
        return "sample" if self.measured_module else "token"

    @property
    def known(self) -> bool:
        """False for a raw parameter count: no layers, so no activations, TP/PP plans or per-layer buffers."""
        return self.n_layers > 0

    @cached_property
    def block_parameters(self) -> int:
        return sum(t.numel for t in self.block)

    @cached_property
    def root_parameters(self) -> int:
        """Embeddings, final norm and head: the root FSDP unit (a tied head is the token embedding)."""
        return sum(t.numel for t in self.embedding + self.head)

    @cached_property
    def matmul_parameters(self) -> int:
        """N' of the FLOPs formula; for a raw count all parameters are taken to be matmul operands."""
        if not self.known:
            return self.num_parameters
        tensors = self.block * self.n_layers + self.embedding + self.head
        active_experts = self.n_layers * self.expert_parameters * self.top_k // max(1, self.num_experts)
        return sum(t.numel for t in tensors if t.in_flops) + active_experts

    @cached_property
    def linear_parameters(self) -> int:
        """Parameters of Linear layers (and the tied head): what autocast casts to 16 bits in forward."""
        tensors = self.block * self.n_layers + self.embedding + self.head
        return sum(t.numel for t in tensors if t.kind in ("linear", "tied"))

    @cached_property
    def largest_module_parameters(self) -> int:
        """Parameters of the largest leaf module (DeepSpeed ZeRO-3 gathers at least one whole module)."""
        if not self.known:
            return 0
        per_module: dict[str, int] = {}
        for t in self.block + self.embedding + self.head:
            per_module[t.module] = per_module.get(t.module, 0) + t.numel
        return max(per_module.values())

    def small_parameters(self, threshold: int) -> int:
        """Elements of the tensors with at most ``threshold`` elements (ZeRO-3's persistent parameters; 0 for a raw
        count, whose tensors are unknown)."""

        def small(tensors: tuple[ParamTensor, ...]) -> int:
            return sum(t.numel for t in tensors if t.numel <= threshold)

        return self.n_layers * small(self.block) + small(self.embedding + self.head)

    def fsdp_shard_parameters(self, shards: int) -> int:
        """Parameter elements one rank holds when every tensor is sharded over ``shards`` ranks on dim 0."""
        if not self.known:
            return math.ceil(self.num_parameters / shards)
        block = sum(t.fsdp_numel(shards) for t in self.block)
        return self.n_layers * block + sum(t.fsdp_numel(shards) for t in self.embedding + self.head)

    def fsdp_block_shard_parameters(self, shards: int) -> int:
        return sum(t.fsdp_numel(shards) for t in self.block)

    def stage_parameters(self, tp: int, pp: int, stage: int, shards: int = 1) -> int:
        """Parameters one rank of pipeline ``stage`` holds under ``tp``-way tensor parallelism (and, with
        ``shards``, its FSDP2 shard of them over the data-parallel ranks, padded per tensor as FSDP2 pads).

        Layers are split evenly; the first stage also holds the embeddings, the last the final norm and head.
        A tied embedding is copied onto the last stage when pp > 1 (Megatron keeps both copies and all-reduces
        their gradients), so it is counted on both.
        """
        if not self.known:
            return math.ceil(math.ceil(self.num_parameters / (tp * pp)) / shards)
        layers = self.n_layers // pp
        return layers * self.block_tp_numel(tp, shards) + sum(
            t.tp_numel(tp, shards) for t in self.stage_root(pp, stage)
        )

    def block_tp_numel(self, tp: int, shards: int = 1) -> int:
        """One block's elements on a TP rank (its FSDP2 shard with ``shards``); memoized, the planner asks for
        the same few degrees across hundreds of layouts."""
        key = (tp, shards)
        if key not in self._block_numel:
            self._block_numel[key] = sum(t.tp_numel(tp, shards) for t in self.block)
        return self._block_numel[key]

    @cached_property
    def _block_numel(self) -> dict[tuple[int, int], int]:
        return {}

    def stage_root(self, pp: int, stage: int) -> tuple[ParamTensor, ...]:
        """The tensors of ``stage`` outside its blocks: embeddings on the first, head (+ tied copy) on the last."""
        tensors: tuple[ParamTensor, ...] = ()
        if stage == 0:
            tensors += self.embedding
        if stage == pp - 1:
            tensors += self.head
            if self.tied_embeddings and pp > 1:
                tensors += tuple(t for t in self.embedding if t.kind == "tied")
        return tensors

    def pipeline_rank_parameters(self, tp: int, pp: int, stages: list[int], num_stages: int, shards: int = 1) -> int:
        """Parameters one rank holds when it runs the pipeline ``stages`` of ``num_stages`` (several under
        interleaving and the V schedule, whose rank 0 holds both the embeddings and the head)."""
        if not self.known:
            return math.ceil(math.ceil(self.num_parameters / (tp * pp)) / shards)
        key = (tp, tuple(stages), num_stages, shards)
        if key not in self._rank_numel:
            self._rank_numel[key] = sum(self.stage_parameters(tp, num_stages, stage, shards) for stage in stages)
        return self._rank_numel[key]

    @cached_property
    def _rank_numel(self) -> dict[tuple[int, tuple[int, ...], int, int], int]:
        return {}


def _linear(name: str, d_out: int, d_in: int, bias: bool, tp: str) -> tuple[ParamTensor, ...]:
    weight = ParamTensor(f"{name}.weight", (d_out, d_in), tp, "linear")
    if not bias:
        return (weight,)
    # A row-parallel layer's bias is added after the all-reduce, so every TP rank holds all of it.
    return (weight, ParamTensor(f"{name}.bias", (d_out,), "col" if tp == "col" else "rep", "linear"))


def _norm(name: str, cfg: ModelConfig) -> tuple[ParamTensor, ...]:
    weight = ParamTensor(f"{name}.weight", (cfg.d_model,), "rep", "norm")
    if cfg.norm == "layernorm" and cfg.bias:
        return (weight, ParamTensor(f"{name}.bias", (cfg.d_model,), "rep", "norm"))
    return (weight,)


def _mlp(name: str, hidden: int, cfg: ModelConfig) -> tuple[ParamTensor, ...]:
    return (
        *_linear(f"{name}.w1", hidden, cfg.d_model, cfg.bias, "col"),
        *_linear(f"{name}.w2", cfg.d_model, hidden, cfg.bias, "row"),
        *(_linear(f"{name}.w3", hidden, cfg.d_model, cfg.bias, "col") if cfg.mlp == "swiglu" else ()),
    )


def _moe(cfg: ModelConfig) -> tuple[ParamTensor, ...]:
    """An MoE layer (models/moe.py): router, stacked routed experts (no biases), shared experts as one MLP. Under
    tensor parallelism the experts split on dim 0 over the tp ranks (``split_experts_over_tp``: "col"), the shared
    MLP is column/row parallel, the router replicated."""
    e, d, h = cfg.num_experts, cfg.d_model, cfg.expert_hidden
    experts = (
        ParamTensor("mlp.experts.w1", (e, d, h), "col", "expert"),
        ParamTensor("mlp.experts.w2", (e, h, d), "col", "expert"),
        *((ParamTensor("mlp.experts.w3", (e, d, h), "col", "expert"),) if cfg.mlp == "swiglu" else ()),
    )
    shared = _mlp("mlp.shared", cfg.num_shared_experts * h, cfg) if cfg.num_shared_experts else ()
    return (ParamTensor("mlp.router.weight", (e, d), "rep", "linear"), *experts, *shared)


def model_shape(cfg: ModelConfig, head_dim: int | None = None) -> ModelShape:
    """The reference transformer's tensors for ``cfg``: the same names and shapes ``Transformer(cfg)`` has.

    ``head_dim`` other than ``d_model / n_heads`` (PaLM's 48 heads of 256 at d_model 18432) plans a shape the
    reference transformer does not build: q/k/v project to ``heads x head_dim`` and the output projection back.
    """
    head_dim = head_dim or cfg.head_dim
    q_dim, kv_dim = cfg.n_heads * head_dim, cfg.kv_heads * head_dim
    block = (
        *_norm("norm1", cfg),
        *_linear("attn.wq", q_dim, cfg.d_model, cfg.bias, "col"),
        *_linear("attn.wk", kv_dim, cfg.d_model, cfg.bias, "col"),
        *_linear("attn.wv", kv_dim, cfg.d_model, cfg.bias, "col"),
        *_linear("attn.wo", cfg.d_model, q_dim, cfg.bias, "row"),
        *_norm("norm2", cfg),
        *(_moe(cfg) if cfg.is_moe else _mlp("mlp", cfg.ffn_hidden, cfg)),
    )
    tok_kind = "tied" if cfg.tie_embeddings else "lookup"
    embedding: tuple[ParamTensor, ...] = (
        ParamTensor("tok_emb.weight", (cfg.vocab_size, cfg.d_model), "vocab", tok_kind),
    )
    if cfg.pos_emb == "learned":
        # Megatron replicates learned position embeddings over tensor-parallel ranks.
        embedding += (ParamTensor("pos_emb.weight", (cfg.learned_position_rows, cfg.d_model), "rep", "lookup"),)
    head = _norm("norm", cfg)
    if not cfg.tie_embeddings:
        head += (ParamTensor("lm_head.weight", (cfg.vocab_size, cfg.d_model), "vocab", "linear"),)
    total = cfg.n_layers * sum(t.numel for t in block) + sum(t.numel for t in embedding + head)
    return ModelShape(
        name=cfg.name,
        num_parameters=total,
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        kv_heads=cfg.kv_heads,
        head_dim=head_dim,
        ffn_hidden=cfg.ffn_hidden,
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
        swiglu=cfg.mlp == "swiglu",
        norm_statistics=2 if cfg.norm == "layernorm" else 1,
        dropout=cfg.dropout,
        tied_embeddings=cfg.tie_embeddings,
        block=block,
        embedding=embedding,
        head=head,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k if cfg.is_moe else 0,
        shared_experts=cfg.is_moe and cfg.num_shared_experts > 0,
    )


def count_shape(num_parameters: int, seq_len: int, name: str = "raw") -> ModelShape:
    """A model known only by its parameter count: model states are exact, activations unknown (0)."""
    if num_parameters < 1:
        raise ValueError(f"num_parameters must be >= 1, got {num_parameters}")
    return ModelShape(name=name, num_parameters=num_parameters, seq_len=seq_len)


def model_flops_per_token(matmul_parameters: float, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> float:
    """Model FLOPs per trained token, ``6 N + 12 L H Q T`` (Chowdhery et al. 2022, PaLM, appendix B)."""
    return 6.0 * matmul_parameters + 12.0 * n_layers * n_heads * head_dim * seq_len


def hardware_flops_per_token(shape: ModelShape, seq_len: int, recompute: str) -> float:
    """FLOPs executed per token: model FLOPs plus the forward work recomputation repeats.

    Full recomputation repeats every block's forward (2 FLOPs per block parameter plus the forward attention
    matmuls, a third of 12 L H Q T); selective recomputation repeats only the attention core (Korthikanti et
    al. 2022). A raw parameter count has no attention term and no blocks to recompute; a measured module's FLOPs
    are its sample's, counted (its "token" is the sample, and it plans no recomputation).
    """
    if shape.flops_per_sample is not None:
        return shape.flops_per_sample
    flops = model_flops_per_token(shape.matmul_parameters, shape.n_layers, shape.n_heads, shape.head_dim, seq_len)
    attention_forward = 4.0 * shape.n_layers * shape.n_heads * shape.head_dim * seq_len
    if recompute == "full":
        flops += 2.0 * shape.n_layers * shape.active_block_parameters + attention_forward
    elif recompute == "selective":
        flops += attention_forward
    return flops
