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


def _rank() -> int:
    import os

    return int(os.environ.get("LOCAL_RANK", "0"))


class SlowCountingData(CountingData):
    """CountingData whose batches take ``delay_s`` each to produce: an input-bound run."""

    def __init__(self, seq_len: int, micro_batch_size: int, delay_s: float = 0.15) -> None:
        super().__init__(seq_len, micro_batch_size)
        self.delay_s = delay_s

    def train_dataloader(self) -> DataLoader:
        import time

        def slow_collate(items: list) -> tuple[torch.Tensor, torch.Tensor]:
            time.sleep(self.delay_s)
            return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])

        return DataLoader(
            self.data, batch_size=self.micro_batch_size, shuffle=True, drop_last=True, collate_fn=slow_collate
        )


class _SlowItems(torch.utils.data.Dataset):
    """A dataset whose every item takes ``delay_s`` to load (a decode, a read): loader workers parallelize it."""

    def __init__(self, data: TensorDataset, delay_s: float) -> None:
        self.data, self.delay_s = data, delay_s

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        import time

        time.sleep(self.delay_s)
        return self.data[index]


class SlowLoaderData(CountingData):
    """An input-bound datamodule that takes ``num_workers`` (a user's ``+data.num_workers=N`` reaches it)."""

    def __init__(self, seq_len: int, micro_batch_size: int, num_workers: int = 0, delay_s: float = 0.03) -> None:
        super().__init__(seq_len, micro_batch_size)
        self.num_workers, self.delay_s = num_workers, delay_s

    def train_dataloader(self) -> DataLoader:
        items = _SlowItems(self.data, self.delay_s)
        workers = {"num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}
        return DataLoader(items, batch_size=self.micro_batch_size, shuffle=True, drop_last=True, **workers)


class SleepyRankModel(BigramModel):
    """BigramModel whose forward sleeps ``sleep_s`` on local rank ``slow_rank``: a straggler DDP hides."""

    def __init__(self, vocab_size: int, seq_len: int, slow_rank: int = 1, sleep_s: float = 0.2) -> None:
        super().__init__(vocab_size, seq_len)
        self.slow = _rank() == slow_rank
        self.sleep_s = sleep_s

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.slow:
            import time

            time.sleep(self.sleep_s)
        return super().forward(tokens)


class WideModel(nn.Module):
    """Many parameters, little compute per token: DDP's all-reduce dominates (comm-bound)."""

    def __init__(self, vocab_size: int, seq_len: int, width: int = 2048, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


class HangingRankModel(BigramModel):
    """Blocks forever in forward on local rank ``stuck_rank`` from the ``at_call``-th forward on."""

    def __init__(self, vocab_size: int, seq_len: int, stuck_rank: int = 1, at_call: int = 5) -> None:
        super().__init__(vocab_size, seq_len)
        self.stuck = _rank() == stuck_rank
        self.at_call = at_call
        self.calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.stuck and self.calls >= self.at_call and self.training:
            import threading

            threading.Event().wait()  # never set: this rank hangs outside any collective
        return super().forward(tokens)


class InfAtStepModel(BigramModel):
    """BigramModel whose logits are +inf on local rank ``inf_rank`` at the given training steps (0-based).

    The loss of those steps is NaN on that rank only, so the other ranks see a non-finite value only through
    the gradient all-reduce (DDP) or not at all (FSDP shards): what the non-finite guard's vote is for.
    """

    def __init__(self, vocab_size: int, seq_len: int, inf_steps: list[int] | None = None, inf_rank: int = 1) -> None:
        super().__init__(vocab_size, seq_len)
        self.inf_steps = set(inf_steps or [])
        self.active = _rank() == inf_rank
        self.training_calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = super().forward(tokens)
        if not self.training:
            return logits
        step, self.training_calls = self.training_calls, self.training_calls + 1
        if self.active and step in self.inf_steps:
            return logits + float("inf")
        return logits


class BigramModelWithCredentials(BigramModel):
    """A model whose factory takes credentials (as one that downloads weights would): they must never be saved."""

    def __init__(self, vocab_size: int, seq_len: int, api_token: str = "", note: str = "") -> None:
        super().__init__(vocab_size, seq_len)
        self.has_credentials = bool(api_token or note)
