"""A user's LightningModule timed whole on a copy (training/module_probe.py, diagnostics.collect.parts), and the
planner composing a step from it (planner/measured.py): a real one-process Trainer, the module a plain Lightning
project's."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from diagnostics.calibration import parts_figures
from diagnostics.collect.parts import time_module_parts
from disttrain.planner.measured import MeasuredParts, parts_basis, parts_compute
from disttrain.planner.shapes import ModelShape
from disttrain.planner.spec import Layout, Workload
from disttrain.training.module_probe import module_parts
from tests.lightning_projects.classifier import ConvNet, DigitsData, LitClassifier

pytestmark = pytest.mark.filterwarnings(
    "ignore:The `srun` command is available", "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"
)


class ProbeAtThirdBatch(pl.Callback):
    """Probe inside a real fit (the module attached to its trainer), the module's state taken around it."""

    def __init__(self) -> None:
        self.before: dict[str, torch.Tensor] = {}
        self.after: dict[str, torch.Tensor] = {}
        self.figures: dict | None = None
        self.caught: list[warnings.WarningMessage] = []
        self.logged_before: dict[str, Any] = {}
        self.logged_after: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx != 2:
            return
        self.before = {k: v.clone() for k, v in pl_module.state_dict().items()}
        self.logged_before = dict(trainer.callback_metrics)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            parts = module_parts(pl_module, batch, trainer.precision_plugin.train_step_context)
            assert parts is not None
            self.figures = time_module_parts(torch.device("cpu"), parts, 16, "fp32", repeats=2)
        self.caught = list(caught)
        self.after = {k: v.clone() for k, v in pl_module.state_dict().items()}
        self.logged_after = dict(trainer.callback_metrics)


def fit(module: pl.LightningModule, callback: pl.Callback, tmp_path: Any) -> None:
    trainer = pl.Trainer(
        max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(module, datamodule=DigitsData(batch_size=16, num_train=128))


def test_the_probe_times_the_module_on_a_copy_and_leaves_the_run_untouched(tmp_path: Any) -> None:
    probe = ProbeAtThirdBatch()
    module = LitClassifier(ConvNet())
    fit(module, probe, tmp_path)
    assert probe.before and probe.before.keys() == probe.after.keys()
    for key in probe.before:  # the copy's SGD steps moved the copy's weights only
        assert torch.equal(probe.before[key], probe.after[key]), key
    assert probe.logged_after == probe.logged_before  # the copy's self.log(sync_dist=True) reached nothing
    assert probe.caught == []  # nor the console
    figures = probe.figures
    assert figures is not None and figures["whole_module"] is True
    assert figures["block_numel"] == sum(p.numel() for p in module.parameters())
    assert (figures["micro_batch"], figures["seq_len"], figures["d_model"]) == (16, 1, 0)
    for key in ("edges_forward_s", "edges_backward_s", "optimizer_step_s"):
        assert 0 < figures[key] < 1.0
    # The ranks' records merge into the figures the planner reads.
    merged = parts_figures([figures, {**figures, "edges_forward_s": 3 * figures["edges_forward_s"]}])
    assert merged is not None and merged["edges_forward_s"] == pytest.approx(2 * figures["edges_forward_s"])
    assert MeasuredParts.from_figures(merged) is not None and MeasuredParts.from_figures(merged).whole_module


class Manual(LitClassifier):
    def __init__(self) -> None:
        super().__init__(ConvNet())
        self.automatic_optimization = False


class ReadsTheTrainer(LitClassifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * (1 + 0 * self.trainer.global_step)


@pytest.mark.parametrize("module", [Manual(), ReadsTheTrainer(ConvNet())], ids=["manual", "reads-trainer"])
def test_a_module_that_cannot_run_off_its_trainer_is_not_probed(module: pl.LightningModule) -> None:
    images, labels = torch.randn(4, 1, 12, 12), torch.randint(0, 10, (4,))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    module.trainer = trainer
    assert module_parts(module, (images, labels), trainer.precision_plugin.train_step_context) is None


def whole_module_parts(micro: int, numel: int) -> MeasuredParts:
    return MeasuredParts(0.0, 0.0, 0.004, 0.006, 0.001, micro, 1, 0, 0, numel, "fp32")


def test_the_planner_composes_a_modules_step_from_its_parts_and_scales_them_by_samples() -> None:
    shape = ModelShape("lit", 7018, seq_len=1, optimizer_states=1.0, activation_bytes_per_sample=0.0)
    ddp = Layout("ddp", dp=2, microbatches=1)
    same = Workload(64, 128, 1, "fp32")
    assert parts_basis(whole_module_parts(64, 7018), shape, same) == "measured"
    measured = parts_compute(whole_module_parts(64, 7018), shape, ddp, same, 7018)
    assert (measured.forward_s, measured.backward_s, measured.optimizer_step_s) == pytest.approx((0.004, 0.006, 0.001))
    double = Workload(128, 256, 1, "fp32")
    assert parts_basis(whole_module_parts(64, 7018), shape, double) == "scaled"
    scaled = parts_compute(whole_module_parts(64, 7018), shape, ddp, double, 3509)  # a ZeRO shard's parameters
    assert (scaled.forward_s, scaled.backward_s, scaled.optimizer_step_s) == pytest.approx((0.008, 0.012, 0.0005))
    # Another module's parts, or a module's parts for a transformer: no formula carries them over.
    assert parts_basis(whole_module_parts(64, 9999), shape, same) is None
    gpt = ModelShape("gpt", 1000, n_layers=2, d_model=64, n_heads=2, head_dim=32, vocab_size=16, seq_len=8)
    assert parts_basis(whole_module_parts(64, 1000), gpt, Workload(64, 128, 8, "fp32")) is None


def test_the_timing_keeps_the_third_batch_and_records_the_runs_peak_before_its_copy() -> None:
    """What the diagnostics callback does with ``RunFacts.module_probe``: the third training batch kept, the module
    timed once training ended, the run's peak memory read before the copy existed (job/finish.py reports it)."""
    from types import SimpleNamespace

    from diagnostics.collect.module_timing import ModuleTiming

    module = LitClassifier(ConvNet())
    batches = [(torch.randn(16, 1, 12, 12), torch.randint(0, 10, (16,))) for _ in range(4)]
    seen: list[Any] = []

    def probe(m: pl.LightningModule, batch: Any, trainer: Any) -> dict | None:
        seen.append(batch)
        return module_parts(m, batch, contextlib.nullcontext)

    facts = SimpleNamespace(module_probe=probe, micro_batch_size=16, precision="fp32")
    timing = ModuleTiming(facts, calibrate=True)  # type: ignore[arg-type]
    for batch in batches:
        timing.batch_started(batch)
    written: list[tuple[str, dict]] = []
    timing.run(None, module, lambda name, fn: fn(), lambda kind, **f: written.append((kind, f)))  # type: ignore[arg-type]
    assert seen == [batches[2]] and [kind for kind, _ in written] == ["parts_calibration"]
    assert timing.peak_before is not None and timing.peak_before > 0
    off = ModuleTiming(facts, calibrate=False)  # type: ignore[arg-type]
    off.batch_started(batches[0])
    off.run(None, module, lambda name, fn: fn(), lambda kind, **f: written.append((kind, f)))  # type: ignore[arg-type]
    assert off.peak_before is None and len(written) == 1
