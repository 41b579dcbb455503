"""A user's own model and datamodule, plugged in by ``_target_`` (see README, "Your own model or data")."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class BigramModel(nn.Module):
    """Next token from the current one only: tiny, and enough to learn a counting sequence."""

    def __init__(self, vocab_size: int, seq_len: int, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * self.head.weight.numel()


class CountingData(pl.LightningDataModule):
    """Sequences ``k, k+1, ...`` mod ``modulus``: the next token is fully determined by the current one."""

    def __init__(self, seq_len: int, micro_batch_size: int, modulus: int = 10, num_sequences: int = 256) -> None:
        super().__init__()
        starts = torch.arange(num_sequences) % modulus
        windows = (starts[:, None] + torch.arange(seq_len + 1)[None, :]) % modulus
        self.data = TensorDataset(windows[:, :-1], windows[:, 1:])
        self.micro_batch_size = micro_batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.micro_batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.micro_batch_size, drop_last=True)
