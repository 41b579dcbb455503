"""The transformer block's feed-forward network, shared by the dense block and an MoE layer's shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.config.schema import ModelConfig


class MLP(nn.Module):
    """GELU(tanh) MLP ``w2(gelu(w1 x))`` or SwiGLU ``w2(silu(w1 x) * w3 x)``; ``w2`` is the residual output."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=cfg.bias)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=cfg.bias) if self.swiglu else None
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.w1(x)) * self.w3(x) if self.w3 is not None else F.gelu(self.w1(x), approximate="tanh")
        return self.resid_drop(self.w2(h))
