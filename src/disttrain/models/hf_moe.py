"""``transformers``' mixture-of-experts blocks (Mixtral, Qwen2-MoE, OLMoE, ...) as the project's expert layers.

Since transformers 5 these families hold a block's experts fused: one module with ``gate_up_proj [E, 2h, d]`` and
``down_proj [E, d, h]``, called as ``experts(tokens [N, d], top_k_index [N, k], top_k_weights [N, k])`` by the
block after its router (``gate``: logits, weights, indices). ``adopt_hf_experts`` swaps each such module for an
``HFExperts`` holding the same two parameters (same names: checkpoints and ``save_pretrained`` are unchanged) that
computes the same function through the shared expert-parallel exchange (``ExpertLayer.run_experts``), so
``strategy.ep`` slices them on dim 0 as it does the built-in model's, and the load counters and all-to-all timing
work for them.

The balancing loss: HF adds ``router_aux_loss_coef x E x sum_e f_e P_e`` (f_e: the fraction of tokens routed to e)
to its own loss, from one rank's batch. Here the same weight and scale, averaged over the MoE layers, is computed
from the counts of the whole data-parallel batch (``ExpertLayer.balancing_loss``), so N ranks train what one
process trains; it is on whenever ``router_aux_loss_coef > 0`` (HF's ``output_router_logits`` switch governs only
HF's own loss, which the project does not use). A router z-loss and a capacity limit are not part of these models.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.models.moe import ExpertLayer, compute_weights, grouped_matmul, use_grouped_gemm

FUSED_WEIGHTS = ("gate_up_proj", "down_proj")
BALANCE_KEY = "model.config.router_aux_loss_coef"


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a fused expert bank this file can run: ``gate_up_proj [E, 2h, d]`` (gate rows first)
    and ``down_proj [E, d, h]``, nothing else trainable (no biases, not transposed)."""
    params = dict(module.named_parameters(recurse=False))
    if set(params) != set(FUSED_WEIGHTS):
        return False
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.dim() != 3 or down.dim() != 3:
        return False
    experts, two_h, d = gate_up.shape
    return down.shape == (experts, d, two_h // 2) and two_h % 2 == 0 and callable(getattr(module, "act_fn", None))


class HFExperts(ExpertLayer):
    """A transformers fused expert bank run as an ``ExpertLayer``: same parameters, same function."""

    balance_key: str | None = BALANCE_KEY
    capacity_key = None  # dropless, as the HF models are

    def __init__(self, original: nn.Module, router: nn.Module, aux_loss_coef: float, aux_loss_setting: float) -> None:
        super().__init__()
        num_experts = int(original.gate_up_proj.shape[0])
        self._init_routing(num_experts, int(router.top_k), aux_loss_coef, 0.0, None)
        self.aux_loss_setting = aux_loss_setting  # the value of balance_key (aux_loss_coef is its per-layer share)
        self.gate_up_proj = original.gate_up_proj
        self.down_proj = original.down_proj
        self.act_fn = original.act_fn
        self.offset = 0  # slot of the first local expert (its global id unless placed)
        self.grad_scale = 1.0  # 1 / ep under expert parallelism (see ScaleGrad)
        self.grouped_gemm: bool | None = None  # None: where grouped_gemm_fits; True/False force it (tests)
        self._logits: torch.Tensor | None = None
        # Held outside the module tree (a tuple): the router is the MoE block's child, not this layer's.
        self._router = (router,)
        router.register_forward_hook(self._keep_logits)

    @property
    def routing_module(self) -> nn.Module:
        return self._router[0]

    def _keep_logits(self, module: nn.Module, args: Any, output: Any) -> None:
        # The router returns (logits, top-k weights, top-k indices); the balancing loss needs the logits.
        self._logits = output[0] if isinstance(output, tuple) else None

    def expert_weights(self) -> list[nn.Parameter]:
        return [self.gate_up_proj, self.down_proj]

    def expert_module(self) -> nn.Module:
        return self

    @property
    def first_expert(self) -> int:
        return self.offset

    def keep_experts(self, keep: slice, grad_scale: float) -> None:
        rows = self.slot_ids(keep)
        for name in FUSED_WEIGHTS:
            setattr(self, name, nn.Parameter(getattr(self, name).detach()[rows].clone()))
        self.offset = keep.start
        self.grad_scale = grad_scale
        self.held_experts = keep.stop - keep.start

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        self._count(0, top_k_index)
        logits, self._logits = self._logits, None
        self.aux_loss = None
        if self.training and self.aux_loss_coef and logits is not None:
            logits = logits.float()
            self.aux_loss = self.balancing_loss(logits, logits.softmax(-1), top_k_index)
        n, k = top_k_index.shape
        flat_expert = top_k_index.reshape(-1)
        flat_token = torch.arange(n, device=hidden.device).repeat_interleave(k)
        flat_slot = self.to_slots(flat_expert)
        order = torch.argsort(flat_slot, stable=True)
        counts = torch.bincount(flat_slot, minlength=self.num_experts)
        routed = self.run_experts(hidden[flat_token[order]], counts, self._compute)
        weighted = routed * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden).index_add_(0, flat_token[order], weighted.to(hidden.dtype))

    def _compute(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        gate_up, down = compute_weights([self.gate_up_proj, self.down_proj], self.grad_scale)
        if use_grouped_gemm(self.grouped_gemm, tokens, [gate_up, down]):
            # The weights are stored [E, out, in] (nn.Linear's layout): the GEMM takes their transposed views.
            gate, up = grouped_matmul(tokens, gate_up.transpose(-2, -1), counts).chunk(2, dim=-1)
            return grouped_matmul(self.act_fn(gate) * up, down.transpose(-2, -1), counts)
        outputs, start = [], 0
        # Every local expert runs, even on no tokens: its weights get a zero gradient rather than none, so every
        # rank reduces the same parameters.
        for j, n in enumerate(counts):
            gate, up = F.linear(tokens[start : start + n], gate_up[j]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, down[j]))
            start += n
        return torch.cat(outputs) if outputs else tokens[:0]


def hf_moe_blocks(hf: nn.Module) -> list[tuple[str, nn.Module]]:
    """The sparse MoE blocks of an HF model whose experts this file can run (a ``gate`` router with ``top_k`` and
    fused ``experts``), with their module names."""
    return [
        (name, m)
        for name, m in hf.named_modules()
        if hasattr(getattr(m, "gate", None), "top_k")
        and isinstance(getattr(m, "experts", None), nn.Module)
        and (isinstance(m.experts, HFExperts) or is_fused_experts(m.experts))
    ]


def adopt_hf_experts(hf: nn.Module) -> int:
    """Swap every fused expert bank of ``hf`` for an ``HFExperts`` over the same parameters; returns how many."""
    blocks = [(name, b) for name, b in hf_moe_blocks(hf) if not isinstance(b.experts, HFExperts)]
    setting = float(getattr(hf.config, "router_aux_loss_coef", 0.0) or 0.0)
    for index, (name, block) in enumerate(blocks):
        # HF's loss: setting x E x sum_e f_e P_e over the layers' tokens together; ExpertLayer's per layer is
        # coef x E / k x sum_e f_e P_e, so each layer's share of HF's mean is setting x k / layers.
        coef = setting * int(block.gate.top_k) / len(blocks)
        block.experts = HFExperts(block.experts, block.gate, coef, setting)
        # The decoder layer's index (model.layers.<i>.mlp), else the MoE blocks' order.
        found = re.search(r"layers\.(\d+)\.", name)
        block.experts.layer_id = int(found.group(1)) if found else index
    return len(blocks)
