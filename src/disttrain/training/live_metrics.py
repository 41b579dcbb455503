"""What the console and the report know, in the user's logger while the run goes (CSV, TensorBoard, wandb).

Every ``trainer.log_every_n_steps`` rank 0 logs, from what it already holds on the host: the window's
throughput and MFU/HFU (``Throughput``'s training-only clock), its own step times and phase shares (the
diagnostics' step records), the ranks' gap and the exposed-communication / waiting shares (the diagnostics'
periodic all-gather), memory (the allocator's host-side counters, or the process's RSS on a CPU), the newest NVML
sample, and the gradient norm before clipping (which rides in the non-finite guard's vote). Nothing here
synchronises with the device or the other ranks. A warning-or-critical finding of the cheap mid-run detectors
(``diagnostics.analysis.live``) is shown once on the console and logged with its step. At the end the run's
final tokens/s and MFU/HFU, the very numbers of the report, are logged as ``throughput/*_run``.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch

from diagnostics.analysis.live import (
    FindingsSeen,
    LiveFinding,
    live_findings,
    node_device_metrics,
    ranks_metrics,
    step_metrics,
    window_rate_metrics,
)
from diagnostics.collect.callback import DiagnosticsCallback
from diagnostics.collect.sampler import rss_bytes
from disttrain.launch.env import say
from disttrain.reliability.nan_guard import NonFiniteGuard
from disttrain.training.callbacks import Throughput
from disttrain.training.logger_text import alert, log_text

GIB = float(2**30)
NVML_KEYS = {
    "util_pct": "gpu/util_pct",
    "power_w": "gpu/power_w",
    "sm_clock_mhz": "gpu/sm_clock_mhz",
    "temp_c": "gpu/temp_c",
    "mem_used_bytes": "gpu/mem_used_bytes",
}


def memory_metrics(device: torch.device, host_memory_bytes: int) -> dict[str, float]:
    """``memory/`` keys: the caching allocator's counters on a GPU (host-side bookkeeping, no device sync), else
    the process's resident memory against the host's."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        reserved = torch.cuda.memory_reserved(device)
        return {
            "memory/allocated_gib": torch.cuda.memory_allocated(device) / GIB,
            "memory/reserved_gib": reserved / GIB,
            "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "memory/reserved_pct": 100.0 * reserved / total,
        }
    rss = rss_bytes()
    return {"memory/host_rss_gib": rss / GIB, "memory/host_rss_pct": 100.0 * rss / host_memory_bytes}


def gpu_metrics(sample: dict[str, Any] | None) -> dict[str, float]:
    """``gpu/`` keys from the sampler's newest NVML reading of this rank's device (none on a CPU)."""
    if not sample or sample.get("source") != "nvml":
        return {}
    return {key: float(sample[name]) for name, key in NVML_KEYS.items() if sample.get(name) is not None}


def logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning logs this batch's loss at (as ``LearningRateMonitor`` does), so every key of one batch
    lines up with ``train/loss`` in every logger; during a batch's end hooks it is the optimizer steps before it."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


class LiveMetrics(pl.Callback):
    """Grouped scalars (``throughput/ time/ memory/ comm/ ranks/ optim/ gpu/ findings/``) to every logger of the
    run, from rank 0, every ``every_n_steps`` optimizer steps; added only where diagnostics are on."""

    def __init__(
        self,
        every_n_steps: int,
        diagnostics: DiagnosticsCallback,
        throughput: Throughput,
        guard: NonFiniteGuard | None,
    ) -> None:
        self.every_n_steps = max(1, every_n_steps)
        self.diagnostics = diagnostics
        self.throughput = throughput
        self.guard = guard
        self.seen = FindingsSeen()
        self._last_logged = -1
        self._last_gather = -1
        self._mark: tuple[int, float] | None = None  # (step, Throughput.train_time_s) at the previous log
        self._host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or step == self._last_logged or step % self.every_n_steps:
            return
        self._last_logged = step
        # Counted with the collectors' own time (the ``end`` record): the overhead benchmark reports it.
        self.diagnostics.timed(lambda: self._log(trainer, pl_module, step))

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        metrics = {
            **self._throughput(trainer, step),
            **self._steps(),
            **memory_metrics(pl_module.device, self._host_memory),
            **gpu_metrics(self.diagnostics.sampler.latest if self.diagnostics.sampler is not None else None),
            **self._optim(),
        }
        findings = self._ranks(step, metrics)
        for f in findings:
            metrics[f"findings/{f.kind}"] = f.cost
        at = logging_step(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=at)
        for f in findings:
            say(f"diagnostics (mid-run): {f.line()}")
            log_text(trainer.loggers, f"findings/{f.kind}", f.line(), at)
            alert(trainer.loggers, f"{f.severity} {f.kind} at step {step}", f.line(), f.severity == "critical")

    def _throughput(self, trainer: pl.Trainer, step: int) -> dict[str, float]:
        t = self.throughput
        if t.start is None:  # still in the warm-up steps the run's tokens/s leaves out
            return {}
        mark_step, mark_time = self._mark or (t.start_step, 0.0)
        self._mark = (step, t.train_time_s)
        f = self.diagnostics.facts
        return window_rate_metrics(
            (step - mark_step) * t.units_per_step,
            t.train_time_s - mark_time,
            trainer.world_size,
            self.diagnostics.flops_per_unit,
            self.diagnostics.hardware_flops_per_unit,
            f.peak_flops,
            self.diagnostics.calibrated,
            unit=f.work_unit,
        )

    def _steps(self) -> dict[str, float]:
        recent = self.diagnostics.take_recent()
        return step_metrics(
            [p.step_s for p in recent], [p.data_wait_s for p in recent], [p.local_compute_s for p in recent]
        )

    def _optim(self) -> dict[str, float]:
        if self.guard is None:
            return {}
        out = {"optim/skipped_steps": float(len(self.guard.skipped_steps))}
        if self.guard.last_grad_norm is not None:
            out["optim/grad_norm"] = self.guard.last_grad_norm[1]
        return out

    def _ranks(self, step: int, metrics: dict[str, float]) -> list[LiveFinding]:
        """The newest gather's keys, when one arrived since the last log, and the findings new in it."""
        windows = self.diagnostics.rank_windows
        if not windows or windows[-1].step == self._last_gather:
            return []
        self._last_gather = windows[-1].step
        metrics.update(ranks_metrics(windows[-1]))
        metrics.update(node_device_metrics(windows[-1]))
        previous = windows[-2] if len(windows) > 1 else None
        return self.seen.new(live_findings(previous, windows[-1]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The run's final tokens/s and MFU/HFU, as its throughput record and report state them."""
        record = self.diagnostics.final_throughput
        if not trainer.is_global_zero or not record:
            return
        rate = f"throughput/{self.diagnostics.facts.work_unit}s_per_s_run"
        names = {
            "tokens_per_s": rate,
            "mfu": "throughput/mfu_run",
            "hfu": "throughput/hfu_run",
            "calibrated_mfu": "throughput/mfu_calibrated_run",
            "calibrated_hfu": "throughput/hfu_calibrated_run",
        }
        metrics = {key: float(record[name]) for name, key in names.items() if record.get(name) is not None}
        metrics[rate.replace("_run", "_per_device_run")] = metrics[rate] / trainer.world_size
        for logger in trainer.loggers:  # the step the last batch's loss was logged at (the counter moved past it)
            logger.log_metrics(metrics, step=max(0, logging_step(trainer) - 1))
