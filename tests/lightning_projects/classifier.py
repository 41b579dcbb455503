"""An image classifier in the lightning-hydra-template style: the network is its own ``nn.Module`` passed in as
``net`` (a nested ``_target_``), SGD with momentum and a StepLR schedule stepped every step."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ConvNet(nn.Module):
    """Two 3x3 convolutions and a linear head over 1 x size x size images."""

    def __init__(self, channels: int = 8, num_classes: int = 10, size: int = 12) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.head = nn.Linear(2 * channels * (size // 2) ** 2, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(images))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


class LitClassifier(pl.LightningModule):
    def __init__(self, net: nn.Module, lr: float = 0.05, momentum: float = 0.9, step_size: int = 20,
                 gamma: float = 0.5) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters(ignore=["net"])
        self.net = net

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, on_step=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.log("val_loss", F.cross_entropy(logits, labels), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == labels).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, self.hparams.step_size, self.hparams.gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class DigitsData(pl.LightningDataModule):
    """Noisy copies of ``num_classes`` fixed random templates: separable, so a small conv net learns them."""

    def __init__(self, batch_size: int = 32, size: int = 12, num_classes: int = 10, num_train: int = 2048,
                 num_val: int = 256, noise: float = 0.8, shuffle: bool = False, seed: int = 0) -> None:  # fmt: skip
        super().__init__()
        self.batch_size, self.shuffle = batch_size, shuffle
        generator = torch.Generator().manual_seed(seed)
        templates = torch.randn(num_classes, 1, size, size, generator=generator)

        def draw(count: int) -> TensorDataset:
            labels = torch.randint(0, num_classes, (count,), generator=generator)
            images = templates[labels] + noise * torch.randn(count, 1, size, size, generator=generator)
            return TensorDataset(images, labels)

        self.train_set, self.val_set = draw(num_train), draw(num_val)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)
