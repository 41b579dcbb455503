"""A matrix-factorization recommender: user and item embedding tables (most of the parameters), a dot product plus
biases, trained with Adam on ratings drawn from a hidden low-rank model. Batches are dicts."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class LitRecommender(pl.LightningModule):
    def __init__(self, num_users: int = 16384, num_items: int = 16384, dim: int = 64, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.users = nn.Embedding(num_users, dim)
        self.items = nn.Embedding(num_items, dim)
        self.user_bias = nn.Embedding(num_users, 1)
        self.item_bias = nn.Embedding(num_items, 1)
        for table in (self.users, self.items):
            nn.init.normal_(table.weight, std=0.1)
        for table in (self.user_bias, self.item_bias):
            nn.init.zeros_(table.weight)

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        dot = (self.users(user) * self.items(item)).sum(-1)
        return dot + self.user_bias(user).squeeze(-1) + self.item_bias(item).squeeze(-1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = F.mse_loss(self(batch["user"], batch["item"]), batch["rating"])
        self.log("train_mse", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_mse", F.mse_loss(self(batch["user"], batch["item"]), batch["rating"]), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class Ratings(Dataset):
    def __init__(self, user: torch.Tensor, item: torch.Tensor, rating: torch.Tensor) -> None:
        self.user, self.item, self.rating = user, item, rating

    def __len__(self) -> int:
        return len(self.user)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"user": self.user[index], "item": self.item[index], "rating": self.rating[index]}


class RatingsData(pl.LightningDataModule):
    """Ratings of a hidden rank-``rank`` model on (user, item) pairs drawn from the first ``active`` ids."""

    def __init__(self, batch_size: int = 256, num_users: int = 16384, num_items: int = 16384, active: int = 512,
                 rank: int = 4, num_train: int = 65536, num_val: int = 2048, seed: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(seed)
        hidden_users = torch.randn(num_users, rank, generator=generator)
        hidden_items = torch.randn(num_items, rank, generator=generator)

        def draw(count: int) -> Ratings:
            user = torch.randint(0, min(active, num_users), (count,), generator=generator)
            item = torch.randint(0, min(active, num_items), (count,), generator=generator)
            return Ratings(user, item, (hidden_users[user] * hidden_items[item]).sum(-1) / rank**0.5)

        self.train_set, self.val_set = draw(num_train), draw(num_val)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)
