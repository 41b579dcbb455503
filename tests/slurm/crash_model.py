"""A user model that crashes on one rank of a SLURM job: the failure a sweep must report and survive."""

from __future__ import annotations

import os

import torch

from tests.plugins import BigramModel


class CrashingBigram(BigramModel):
    """BigramModel raising in its ``at_call``-th training forward on global rank ``crash_rank`` only."""

    def __init__(self, vocab_size: int, seq_len: int, crash_rank: int = 1, at_call: int = 3) -> None:
        super().__init__(vocab_size, seq_len)
        self.crashes = int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0"))) == crash_rank
        self.at_call = at_call
        self.calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.crashes and self.calls >= self.at_call:
                raise RuntimeError(f"deliberate crash in training forward {self.calls}")
        return super().forward(tokens)
