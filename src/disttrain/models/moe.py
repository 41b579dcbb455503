"""The mixture-of-experts FFN of the reference transformer: a top-k router, routed experts, optional shared ones.

Parameter names (what the init, the EP plan and the accounting rely on): ``blocks.<i>.mlp.router.weight``
``[E, d]``, ``blocks.<i>.mlp.experts.{w1,w2[,w3]}`` stacked over experts (``[E_local, d, h]``, ``[E_local, h, d]``),
``blocks.<i>.mlp.shared.{w1,w2[,w3]}`` (one MLP of ``num_shared_experts x expert_hidden``, DeepSeek's layout).

Stacked expert weights make expert parallelism a slice along dim 0 (``shard_experts``): a rank holds experts
``[offset, offset + E_local)``. Tokens then travel to the rank holding their expert and back by all-to-all
(models/expert_exchange.py; gloo implements ``all_to_all_single`` with uneven splits on CPU, NCCL on GPU).

In training, the load-balancing loss is computed from the expert counts of the whole data-parallel batch (the
counts are all-reduced over ``balance_group``, by default every rank: data parallelism spans the world under every
strategy that runs MoE layers; a few floats per layer): the mean of the ranks' losses is then exactly the loss of
the global batch, so N ranks train what one process would (Qwen's global-batch balancing). Evaluation forwards,
which need not run on every rank, use this rank's counts.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from disttrain.config.schema import ModelConfig
from disttrain.models.expert_exchange import (
    ALL_TO_ALL_AFTER_EXPERTS,
    AllToAll,
    AttachAuxLoss,
    CommObserver,
    CopyToGroup,
    ReduceFromGroup,
    regroup,
    timed_collective,
)
from disttrain.models.mlp import MLP


class ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times ``scale`` backward: an expert's gradient sums the tokens of all ``ep``
    ranks (all-to-all backward), while the dense parameters' gradients are averaged; ``1 / ep`` makes both means."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None  # type: ignore[attr-defined]


def grouped_gemm_fits(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether one grouped GEMM per projection (``torch._grouped_mm``: every expert's segment in one kernel) should
    replace the per-expert loop: bf16 tokens and weights on a CUDA device of compute capability 9.0+ (H100/H200),
    where the kernel exists and the loop's one launch per expert and projection dominates small experts."""
    if not (x.is_cuda and hasattr(torch, "_grouped_mm")):
        return False
    if x.dtype != torch.bfloat16 or any(w.dtype != torch.bfloat16 for w in weights):
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


def compute_weights(weights: list[torch.Tensor], grad_scale: float) -> list[torch.Tensor]:
    """Stacked expert weights as the expert GEMMs take them: this rank's shard of a tensor-parallel DTensor (sharded
    on the experts; ``to_local``'s gradient comes back as the same shard), gradients scaled by ``grad_scale``."""
    local = [w.to_local() if isinstance(w, DTensor) else w for w in weights]
    return local if grad_scale == 1.0 else [ScaleGrad.apply(w, grad_scale) for w in local]


def use_grouped_gemm(forced: bool | None, x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """``forced`` (tests) or, left None, where ``grouped_gemm_fits``."""
    return forced if forced is not None else grouped_gemm_fits(x, weights)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows of ``x`` in ``len(counts)`` consecutive segments, segment ``j`` times ``weight[j]`` (``[E, K, N]``), as
    one grouped GEMM; an empty segment's weight gets a zero gradient."""
    offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
    return torch._grouped_mm(x, weight, offs=offsets)


class GroupedExperts(nn.Module):
    """``num_local`` expert MLPs with stacked weights; ``forward`` takes tokens sorted by expert and the counts."""

    def __init__(self, cfg: ModelConfig, num_local: int, offset: int = 0) -> None:
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.offset = offset  # slot of the first local expert (expert parallelism): its global id unless placed
        self.ids: list[int] | None = None  # global ids of the local rows when placed (strategy.expert_placement)
        self.grad_scale = 1.0  # 1 / ep under expert parallelism (see ScaleGrad)
        self.grouped_gemm: bool | None = None  # None: where grouped_gemm_fits; True/False force it (tests)
        d, h = cfg.d_model, cfg.expert_hidden
        self.w1 = nn.Parameter(torch.empty(num_local, d, h))
        self.w2 = nn.Parameter(torch.empty(num_local, h, d))
        self.w3 = nn.Parameter(torch.empty(num_local, d, h)) if self.swiglu else None

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        weights = [self.w1, self.w2] + ([self.w3] if self.w3 is not None else [])
        weights = compute_weights(weights, self.grad_scale)
        w1, w2 = weights[0], weights[1]
        w3 = weights[2] if self.swiglu else None
        if use_grouped_gemm(self.grouped_gemm, x, weights):
            a = grouped_matmul(x, w1, counts)
            a = F.silu(a) * grouped_matmul(x, w3, counts) if w3 is not None else F.gelu(a, approximate="tanh")
            return grouped_matmul(a, w2, counts)
        outputs, start = [], 0
        # Every expert runs, even on zero tokens: its weights then get a zero gradient instead of none, so the
        # gradient reduction sees the same parameters on every rank.
        for j, n in enumerate(counts):
            h = x[start : start + n]
            a = h @ w1[j]
            a = F.silu(a) * (h @ w3[j]) if w3 is not None else F.gelu(a, approximate="tanh")
            outputs.append(a @ w2[j])
            start += n
        return torch.cat(outputs) if outputs else x[:0]


class ExpertLayer(nn.Module, abc.ABC):
    """What strategies, checkpoints and diagnostics need of a layer of routed experts, whoever wrote it.

    The built-in ``MoE`` and a ``transformers`` MoE block's experts (models/hf_moe.py) both hold their experts as
    weights stacked on dim 0 and share: the expert-parallel exchange (``run_experts``), the load counters read once
    per optimizer step (``take_counts``), the balancing loss over the whole data-parallel batch
    (``balancing_loss``) and the collectives' timing hook (``comm_observer``).
    """

    def _init_routing(
        self, num_experts: int, top_k: int, aux_loss_coef: float, z_loss_coef: float, capacity_factor: float | None
    ) -> None:
        self.num_experts = num_experts
        self.top_k = top_k
        self.aux_loss_coef = aux_loss_coef
        self.aux_loss_setting = aux_loss_coef  # the value of balance_key that gives aux_loss_coef
        self.z_loss_coef = z_loss_coef
        self.capacity_factor = capacity_factor
        self.ep_group: object | None = None  # set by shard_experts
        self.ep_size = 1
        # Under tensor parallelism (split_experts_over_tp) the tp ranks, which all hold every token, split the
        # experts: each computes its own on all tokens and the outputs are summed over the group.
        self.tp_group: object | None = None
        self.tp_size = 1
        self.held_experts = num_experts  # experts this rank computes
        # strategy.expert_placement: slot -> global expert id (the ep group's k-th rank holds slots [k E / ep, ...))
        # and its inverse; None: slot = id. Routing, counters and checkpoints speak global ids, the exchange slots.
        self.placement: list[int] | None = None
        self.slot_of: torch.Tensor | None = None
        self.layer_id: int | None = None  # the block's index in the whole model, where the builder says
        self.comm_observer: CommObserver | None = None  # told the seconds of each collective (diagnostics)
        # The data-parallel group whose batch the balancing loss sees (None: all).
        self.balance_group: object | None = None
        self.aux_loss: torch.Tensor | None = None  # this forward's balancing + z-loss, weighted
        # Set (to the objective's scale of one micro-batch) where the strategy cannot add aux_loss to the objective
        # (pipeline stages): the layer then attaches its gradient to its output (AttachAuxLoss).
        self.attach_aux_scale: float | None = None
        # Cheap counters, read and reset by the diagnostics once per optimizer step: per global expert, the
        # assignments routed from this rank's tokens (before dropping) and those dropped over capacity. Kept on the
        # compute device (no sync per forward); not on meta, where the model is first built.
        self.tokens_per_expert = torch.zeros(2, num_experts, dtype=torch.int64, device="cpu")

    # -- what each kind of layer says about its weights -------------------------------------------------------
    # Override keys a report offers for the balancing coefficient and the capacity (None: the layer has none).
    balance_key: str | None = "model.aux_loss_coef"
    capacity_key: str | None = "model.capacity_factor"

    @property
    @abc.abstractmethod
    def routing_module(self) -> nn.Module:
        """The module whose output routes the tokens: the router logits (built-in), or transformers' router's
        (logits, top-k weights, top-k indices)."""

    @abc.abstractmethod
    def expert_weights(self) -> list[nn.Parameter]:
        """The stacked expert weights ``[E_local, ...]``."""
        ...

    @abc.abstractmethod
    def expert_module(self) -> nn.Module:
        """The module holding exactly the expert weights (FSDP2 shards it over the ranks holding the same experts)."""
        ...

    @property
    @abc.abstractmethod
    def first_expert(self) -> int:
        """Slot of this rank's first expert (its global id unless ``placement`` says otherwise)."""

    @abc.abstractmethod
    def keep_experts(self, keep: slice, grad_scale: float) -> None:
        """Hold only the experts in slots ``keep`` (rows ``held_ids``), their gradients scaled by ``grad_scale``."""
        ...

    def place(self, placement: list[int] | None) -> None:
        """Set which expert each slot holds (before ``keep_experts``); None or the identity: slot = id."""
        if placement is None or placement == list(range(self.num_experts)):
            self.placement, self.slot_of = None, None
            return
        self.placement = list(placement)
        self.slot_of = torch.argsort(torch.tensor(placement))

    def slot_ids(self, keep: slice) -> list[int]:
        """Global ids of the experts in slots ``keep``."""
        slots = range(keep.start, keep.stop)
        return [self.placement[s] for s in slots] if self.placement is not None else list(slots)

    @property
    def held_ids(self) -> list[int]:
        """Global ids of this rank's experts, in the order of its stacked weights' rows."""
        return self.slot_ids(slice(self.first_expert, self.first_expert + self.num_local))

    def to_slots(self, experts: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> the slots the exchange sorts by (unchanged without a placement)."""
        if self.slot_of is None:
            return experts
        if self.slot_of.device != experts.device:
            self.slot_of = self.slot_of.to(experts.device)
        return self.slot_of[experts]

    @property
    def num_local(self) -> int:
        return self.held_experts

    @property
    def expert_ranks(self) -> int:
        """How many ranks split the experts of a layer (by all-to-all under EP, by summed outputs under TP)."""
        return self.ep_size * self.tp_size

    # -- shared behaviour -------------------------------------------------------------------------------------
    def take_counts(self) -> tuple[list[int], list[int]]:
        """(routed, dropped) assignments per expert since the last call, then zeroed (one device-to-host copy)."""
        routed, dropped = self.tokens_per_expert.tolist()
        self.tokens_per_expert.zero_()
        return routed, dropped

    # Eager under torch.compile: the counter is moved to the routing's device on first use, and that reassignment
    # traced inside a compiled block left the graph expecting one row of it on the next step (seen on an H200).
    @torch.compiler.disable
    def _count(self, row: int, experts: torch.Tensor) -> None:
        # Validation batches are not part of a step's load, and activation checkpointing's recomputation (a forward
        # run by the autograd engine, inside backward) would count the same tokens twice.
        if not self.training or torch._C._current_graph_task_id() != -1:
            return
        if self.tokens_per_expert.device != experts.device:
            self.tokens_per_expert = self.tokens_per_expert.to(experts.device)
        self.tokens_per_expert[row] += torch.bincount(experts.reshape(-1), minlength=self.num_experts)

    def balancing_loss(self, logits: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor | None:
        """``aux_loss_coef x E x sum_e f_e P_e`` (f_e: share of the global batch's assignments expert e got over its
        even share; P_e: this rank's mean routing probability) plus the z-loss, or None when both weights are 0."""
        loss = None
        if self.aux_loss_coef:
            counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts)
            # Per-expert assignments, then the token count: one all-reduce for both.
            assigned = torch.cat([counts.float(), counts.new_tensor([probs.shape[0]], dtype=torch.float32)])
            if self.training and dist.is_initialized() and dist.get_world_size() > 1:
                timed_collective(self.comm_observer, "all_reduce", dist.all_reduce, assigned, group=self.balance_group)
            # 1 everywhere when balanced. Linear in P, so the ranks' mean is the global batch's loss.
            share = assigned[:-1] * self.num_experts / (assigned[-1] * self.top_k)
            loss = self.aux_loss_coef * (share * probs.mean(0)).sum()
        if self.z_loss_coef:
            z = self.z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean()
            loss = z if loss is None else loss + z
        return loss

    # Eager under torch.compile (model.compile=true compiles whole blocks): the experts' token counts are data,
    # and traced as shapes they recompile every step and then fail (an expert given no tokens).
    @torch.compiler.disable
    def run_experts(
        self, x: torch.Tensor, counts: torch.Tensor, compute: Callable[[torch.Tensor, list[int]], torch.Tensor]
    ) -> torch.Tensor:
        """Expert outputs for tokens ``x`` sorted by global expert (``counts`` per expert); ``compute(tokens,
        counts)`` runs this rank's experts on tokens sorted by local expert. Under EP the tokens travel by all-to-all
        to the ranks holding their experts and back."""
        if self.tp_group is not None:
            # Every tp rank holds all tokens: run this rank's experts on theirs; the other rows stay 0 (their
            # experts' ranks fill them) until the caller sums the weighted outputs over the group.
            first, local = self.first_expert, self.num_local
            begin = int(counts[:first].sum())
            mine = counts[first : first + local]
            end = begin + int(mine.sum())
            out = x.new_zeros(x.shape)
            out[begin:end] = compute(x[begin:end], mine.tolist())
            return out
        if self.ep_size == 1:
            return compute(x, counts.tolist())
        local = self.num_local
        group, observer = self.ep_group, self.comm_observer
        received = torch.empty_like(counts)
        timed_collective(
            observer, "all_to_all", dist.all_to_all_single, received, counts, group=group
        )  # [source, local expert]
        received = received.view(self.ep_size, local)
        send_splits = counts.view(self.ep_size, local).sum(1).tolist()
        recv_splits = received.sum(1).tolist()
        before, after = "all_to_all", ALL_TO_ALL_AFTER_EXPERTS
        tokens = AllToAll.apply(x, recv_splits, send_splits, group, observer, (before, after))  # dispatch
        by_expert = regroup(received)
        out = compute(tokens[by_expert], received.sum(0).tolist())
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
        return AllToAll.apply(out[back], send_splits, recv_splits, group, observer, (after, before))  # combine


class MoE(ExpertLayer):
    """Routed experts (+ shared experts) replacing a block's MLP; records its auxiliary loss and token counts."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self._init_routing(cfg.num_experts, cfg.top_k, cfg.aux_loss_coef, cfg.z_loss_coef, cfg.capacity_factor)
        self.gate = cfg.router_gate
        self.norm_topk = cfg.router_norm_topk
        self.router = nn.Linear(cfg.d_model, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg, cfg.num_experts)
        # Under TP the expert weights are DTensors sharded on dim 0 over the tp ranks (their global shape and
        # init stay the one-process ones): this rank's first expert is tp_offset.
        self.tp_offset = 0
        shared_hidden = cfg.num_shared_experts * cfg.expert_hidden
        self.shared = MLP(replace(cfg, ffn_hidden=shared_hidden)) if cfg.num_shared_experts else None

    @property
    def routing_module(self) -> nn.Module:
        return self.router

    def expert_weights(self) -> list[nn.Parameter]:
        return [w for w in (self.experts.w1, self.experts.w2, self.experts.w3) if w is not None]

    def expert_module(self) -> nn.Module:
        return self.experts

    @property
    def first_expert(self) -> int:
        return self.experts.offset + self.tp_offset

    def keep_experts(self, keep: slice, grad_scale: float) -> None:
        experts = self.experts
        rows = self.slot_ids(keep)
        for name in ("w1", "w2", "w3"):
            weight = getattr(experts, name)
            if weight is not None:
                setattr(experts, name, nn.Parameter(weight.detach()[rows].clone()))
        experts.offset = keep.start
        experts.ids = rows if self.placement is not None else None
        experts.grad_scale = grad_scale
        self.held_experts = keep.stop - keep.start

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids and gate weights ``[N, k]`` of tokens ``x [N, d]``; sets ``aux_loss``."""
        logits = self.router(x).float()
        scores = logits.softmax(-1) if self.gate == "softmax" else logits.sigmoid()
        weights, experts = scores.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        self._count(0, experts)
        probs = scores if self.gate == "softmax" else scores / scores.sum(-1, keepdim=True)
        self.aux_loss = self.balancing_loss(logits, probs, experts)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n = x.shape[0]
        experts, weights = self.route(x)
        # Choice-major order (all first choices, then all second ones): capacity keeps first choices first.
        flat_expert = experts.t().reshape(-1)
        flat_token = torch.arange(n, device=x.device).repeat(self.top_k)
        flat_weight = weights.t().reshape(-1)
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * n * self.top_k / self.num_experts)
            one_hot = F.one_hot(flat_expert, self.num_experts)
            position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1
            keep = position < capacity
            self._count(1, flat_expert[~keep])
            flat_expert, flat_token, flat_weight = flat_expert[keep], flat_token[keep], flat_weight[keep]
        flat_slot = self.to_slots(flat_expert)
        order = torch.argsort(flat_slot, stable=True)
        counts = torch.bincount(flat_slot, minlength=self.num_experts)
        tokens = x
        if self.tp_group is not None:
            tokens = CopyToGroup.apply(x, self.tp_group, self.comm_observer)
            flat_weight = CopyToGroup.apply(flat_weight, self.tp_group, self.comm_observer)
        routed = self.run_experts(tokens[flat_token[order]], counts, self.experts)
        out = torch.zeros_like(x).index_add_(0, flat_token[order], routed * flat_weight[order, None])
        if self.tp_group is not None:
            out = ReduceFromGroup.apply(out, self.tp_group, self.comm_observer)
        if self.shared is not None:
            out = out + self.shared(x)
        if self.attach_aux_scale is not None and self.aux_loss is not None and self.training:
            out = AttachAuxLoss.apply(out, self.aux_loss, self.attach_aux_scale)
        return out.view(shape)


def shard_experts(
    model: nn.Module,
    ep_rank: int,
    ep_size: int,
    ep_group: object,
    balance_group: object,
    placement: list[list[int]] | None = None,
) -> int:
    """Keep the experts of slots ``[ep_rank * E / ep, ...)`` of every MoE layer and route through ``ep_group``;
    the balancing statistics come from ``balance_group``. ``placement`` (strategy.expert_placement) says which
    expert each slot holds, per layer or one for all; None: slot = expert id. Returns the MoE layers changed."""
    layers = moe_layers(model)
    if placement is not None and len(placement) not in (1, len(layers)):
        raise ValueError(
            f"strategy.expert_placement has {len(placement)} permutations; the model has {len(layers)} MoE layers "
            "(give one per MoE layer, or one for all)"
        )
    for index, layer in enumerate(layers):
        layer.balance_group = balance_group
        if ep_size == 1:
            continue
        layer.place(None if placement is None else placement[index if len(placement) > 1 else 0])
        local = layer.num_experts // ep_size
        layer.keep_experts(slice(ep_rank * local, (ep_rank + 1) * local), 1.0 / ep_size)
        layer.ep_group, layer.ep_size = ep_group, ep_size
    return len(layers)


def moe_layers(model: nn.Module) -> list[ExpertLayer]:
    return [m for m in model.modules() if isinstance(m, ExpertLayer)]


def auxiliary_loss(layers: list[ExpertLayer]) -> torch.Tensor | None:
    """The sum of the layers' weighted balancing and z-losses from their last forward (None for a dense model)."""
    losses = [layer.aux_loss for layer in layers if layer.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None
