"""A user's module measured on meta (training/footprint.py): states, optimizer, activations and FLOPs as the module
really holds them, checked against the same module run on real tensors and against hand counts."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from disttrain.config.errors import ConfigError
from disttrain.config.schema import CustomDataConfig, LightningModuleConfig
from disttrain.training.footprint import measure_footprint, optimizers_of, saved_activation_bytes

P = "tests.lightning_projects."
HERE = "tests.unit.test_footprint."
CLASSIFIER = LightningModuleConfig(
    target=P + "classifier.LitClassifier", kwargs={"net": {"_target_": P + "classifier.ConvNet"}}
)
DIGITS = CustomDataConfig(target=P + "classifier.DigitsData")
RECOMMENDER = LightningModuleConfig(target=P + "recommender.LitRecommender")
RATINGS = CustomDataConfig(target=P + "recommender.RatingsData")


class TinyMLP(pl.LightningModule):
    """Linear(8, 16) -> ReLU -> Linear(16, 1), MSE; ``item`` reads the loss on the host (no meta kernel for that)."""

    def __init__(self, item: bool = False, optimizer: str = "adam") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.item, self.optimizer = item, optimizer

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if self.item and loss.item() > 1e9:
            return loss * 2
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> object:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)  # no momentum: no state
        adam = torch.optim.Adam(self.parameters())
        return {"optimizer": adam, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(adam, 1)}}


class TinyData(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=self.batch_size)


def test_a_tiny_mlp_matches_its_hand_count() -> None:
    footprint = measure_footprint(
        LightningModuleConfig(target=HERE + "TinyMLP"), CustomDataConfig(target=HERE + "TinyData"), 4
    )
    params = 8 * 16 + 16 + 16 * 1 + 1
    assert (footprint.num_parameters, footprint.parameter_bytes, footprint.gradient_bytes) == (
        params,
        4 * params,
        4 * params,
    )
    assert footprint.optimizer_state_bytes == 2 * 4 * params  # Adam's two moments, fp32 (the step counters aside)
    assert footprint.optimizer_states_per_parameter_byte == 2
    # Saved for backward at 4 rows: the input (first linear's weight gradient, 4x8), the ReLU's output (4x16, which
    # the second linear saves too: one storage), the prediction and the target (mse, 4x1 each); weights not counted.
    assert footprint.activation_bytes == 4 * (4 * 8 + 4 * 16 + 4 + 4)
    assert footprint.micro_batch_size == 4 and footprint.activation_bytes_at(8) == 2 * footprint.activation_bytes
    # FLOPs: forward 2*4*(8*16 + 16*1); backward twice that (the input of the first linear needs no gradient: once).
    forward = 2 * 4 * (8 * 16 + 16)
    assert footprint.flops_per_sample == pytest.approx((forward + 2 * forward - 2 * 4 * 8 * 16) / 4)
    assert footprint.unmeasured == ()


def test_plain_sgd_holds_no_state_and_every_optimizer_form_is_read() -> None:
    footprint = measure_footprint(
        LightningModuleConfig(target=HERE + "TinyMLP", kwargs={"optimizer": "sgd"}),
        CustomDataConfig(target=HERE + "TinyData"),
        4,
    )
    assert footprint.optimizer_state_bytes == 0 and footprint.optimizer_states_per_parameter_byte == 0
    adam = torch.optim.Adam([nn.Parameter(torch.zeros(2))])
    schedule = torch.optim.lr_scheduler.StepLR(adam, 1)
    for form in (
        adam,
        [adam],
        ([adam], [schedule]),
        {"optimizer": adam, "lr_scheduler": schedule},
        [{"optimizer": adam}],
    ):
        assert optimizers_of(form) == [adam]


def test_a_step_that_cannot_run_on_meta_leaves_activations_unknown_with_the_reason() -> None:
    model = LightningModuleConfig(target=HERE + "TinyMLP", kwargs={"item": True})
    footprint = measure_footprint(model, CustomDataConfig(target=HERE + "TinyData"), 4)
    assert footprint.activation_bytes is None and footprint.flops_per_sample is None
    assert footprint.optimizer_state_bytes == 2 * footprint.parameter_bytes  # the states are known without a step
    assert len(footprint.unmeasured) == 1 and footprint.unmeasured[0].startswith("activations and FLOPs: ")
    assert measure_footprint(model, None, 4).unmeasured[0].endswith("(data._target_)")


@pytest.mark.parametrize("micro", [32, 64])
def test_the_classifier_on_meta_saves_what_it_saves_on_real_tensors(micro: int) -> None:
    from tests.lightning_projects import classifier

    footprint = measure_footprint(CLASSIFIER, DIGITS, micro)
    assert footprint.optimizer_state_bytes == footprint.parameter_bytes  # SGD with momentum: one buffer per parameter
    module = classifier.LitClassifier(classifier.ConvNet())
    data = classifier.DigitsData(batch_size=micro)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    saved, flops = saved_activation_bytes(module, batch)  # the same hooks on the real tensors
    assert footprint.activation_bytes == saved and footprint.micro_batch_size == micro
    counter = FlopCounterMode(display=False)
    with counter:
        F.cross_entropy(module(batch[0]), batch[1]).backward()
    assert (
        footprint.flops_per_sample == pytest.approx(flops / micro) == pytest.approx(counter.get_total_flops() / micro)
    )


def test_the_recommender_holds_adam_moments_over_its_embedding_tables() -> None:
    footprint = measure_footprint(RECOMMENDER, RATINGS, 64)
    assert footprint.num_parameters >= 2_000_000 and footprint.parameter_bytes == 4 * footprint.num_parameters
    assert footprint.optimizer_state_bytes == 2 * footprint.parameter_bytes
    assert footprint.activation_bytes is not None and footprint.activation_bytes < footprint.parameter_bytes / 100
    assert footprint.flops_per_sample is None  # lookups and products, no matmul or convolution to count


class BrokenData(TinyData):
    def train_dataloader(self) -> DataLoader:
        raise FileNotFoundError("/data/train.parquet")


def test_a_datamodule_that_gives_no_batch_is_one_line_naming_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        measure_footprint(
            LightningModuleConfig(target=HERE + "TinyMLP"), CustomDataConfig(target=HERE + "BrokenData"), 4
        )
    assert err.value.key == "data._target_" and "FileNotFoundError: /data/train.parquet" in str(err.value)
