"""An MLP regressor: AdamW with a cosine schedule returned in Lightning's list form, a smooth target to fit."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class LitRegressor(pl.LightningModule):
    def __init__(self, in_features: int = 16, hidden: int = 128, depth: int = 3, lr: float = 3e-3,
                 max_steps: int = 100) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        self.mlp = nn.Sequential(*layers, nn.Linear(width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x).squeeze(-1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x).float(), y), sync_dist=True)

    def configure_optimizers(self) -> tuple[list, list]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.hparams.max_steps)
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


class WaveData(pl.LightningDataModule):
    """y = sum_i sin(w_i . x) for a few fixed random directions w_i: smooth, and not linear."""

    def __init__(self, batch_size: int = 64, in_features: int = 16, num_train: int = 8192, num_val: int = 512,
                 seed: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(seed)
        directions = torch.randn(4, in_features, generator=generator) / in_features**0.5

        def draw(count: int) -> TensorDataset:
            x = torch.randn(count, in_features, generator=generator)
            return TensorDataset(x, torch.sin(x @ directions.T).sum(-1))

        self.train_set, self.val_set = draw(num_train), draw(num_val)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class ManualRegressor(LitRegressor):
    """The same regressor stepping its optimizer itself (Lightning's manual optimization)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer, schedule = self.optimizers(), self.lr_schedulers()
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        optimizer.step()
        schedule.step()
        self.log("train_loss", loss, sync_dist=True)
        return loss
