"""A checked run's phases in one process: spawn the local ranks, build the trainer, record the run (config.yaml,
run.json), fit, finish (run.json, the summary, the report). A failure in build, record or fit takes one path
(``failure.stop_fit``); the process role is read once, before anything is spawned (``run.run_from_hydra``)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from diagnostics.crash import retire_crash_records
from diagnostics.manifest import RunManifest
from disttrain.job.failure import FailureReporting, record_hang, stop_fit, stop_for_failure
from disttrain.job.finish import conclude
from disttrain.job.launcher import Launcher
from disttrain.job.launcher_death import stop_watching
from disttrain.job.manifest import record_start, write_start
from disttrain.job.prepare import Prepared
from disttrain.launch.env import ProcessRole, cpu_threads, say
from disttrain.launch.exit_codes import NONFINITE, RunStopped
from disttrain.launch.local import LocalRanks
from disttrain.models.facts import ModelFacts
from disttrain.reliability.nan_guard import agreed_stop, retire_stop_markers, write_stop_marker
from disttrain.training.build import build_run

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from disttrain.training.build import TrainerParts


@dataclass
class Job:
    """This process's part of a checked run, in phases: spawn the local ranks (rank 0 of a local launch), build
    the trainer, record the run, fit, finish."""

    prepared: Prepared
    facts: ModelFacts
    run_dir: Path
    role: ProcessRole
    started: float
    launcher: Launcher  # who starts the local ranks and watches whom (launcher.py)
    manifest: RunManifest = field(default_factory=RunManifest)  # run.json; a rank that dies marks it failed
    failures: FailureReporting = field(init=False)

    def __post_init__(self) -> None:
        report = self.prepared.run_cfg.diagnostics.enabled and self.prepared.run_cfg.diagnostics.report
        reports = not self.role.child and not self.role.cluster
        self.failures = FailureReporting(self.run_dir, self.manifest, report, reports=reports)

    def run(self) -> None:
        """Spawn the local ranks, build, record, fit, finish: the whole job, in the order it happens. Any failure
        while building or fitting ends in ``failure.stop_fit`` (a dead local rank named as the cause)."""
        early = self.launcher.took_early_ranks()  # started before the job was built (launcher.py)
        if self.failures.reports and not early:  # an early start is a new run dir: its ranks may write already
            retire_crash_records(self.run_dir)  # a restart runs in the same run dir
            retire_stop_markers(self.run_dir)
        # A 1-process run has no rank to record its death (SIGKILL, the OOM killer): a torch-free process waits on it.
        watcher = self.launcher.watch_alone(self.prepared)
        try:
            ranks = self.spawn()
            parts: TrainerParts | None = None
            try:
                parts, module, datamodule = self.build()
                self.record()
                checkpoint = self.prepared.checkpoint
                parts.trainer.strategy.resume_weights_only = self.prepared.run_cfg.resume_weights_only  # type: ignore[attr-defined]
                # weights_only: a checkpoint is data, never code (rng.py keeps the RNG states loadable this way).
                parts.trainer.fit(module, datamodule=datamodule, ckpt_path=str(checkpoint) if checkpoint else None,
                                  weights_only=True)  # fmt: skip
                if ranks is not None:
                    # Past the last collective a rank ending (even non-zero: a non-finite stop) cannot hang the others.
                    ranks.stop_watching()
            except BaseException as err:
                stop_fit(err, self.failures, ranks, parts, self.role.child)
            finally:
                if torch.distributed.is_available() and torch.distributed.is_initialized():
                    # Frees what DDP holds; FSDP2/DTensor groups outlive this (C++ hook cycles), see process_exit.py.
                    torch.distributed.destroy_process_group()
            self.finish(parts, datamodule, ranks)
        finally:
            stop_watching(watcher)  # the job ended by itself, and recorded how

    def spawn(self) -> LocalRanks | None:
        """Local ranks 1..n-1, this process joined as rank 0 (the launcher's, started early or now), watched: one
        dying stops the job (None: nothing to spawn)."""
        ranks = self.launcher.join(self.prepared)
        if ranks is None:
            return None
        ranks.agreed_stop = partial(agreed_stop, self.run_dir)  # a rank ending the agreed non-finite stop

        def abort(rank: int, code: int) -> None:
            # The survivors would wait forever in their next collective: stop the whole job now.
            if not self.failures.lock.acquire(blocking=False):
                return  # the main thread is already reporting this failure
            stop = stop_for_failure(self.failures, ranks, [(rank, code)], None)
            say(stop.message, file=sys.stderr)
            os._exit(stop.exit_code)

        ranks.watch(abort)
        return ranks

    def build(self) -> tuple[TrainerParts, pl.LightningModule, pl.LightningDataModule]:
        """Threads and seeds, then the trainer, model and data (training.build); rank 0's hang watchdog names
        the hung rank in run.json before it writes the report."""
        import lightning.pytorch as pl

        run_cfg = self.prepared.run_cfg
        if run_cfg.hw.accelerator == "cpu":
            local = self.prepared.parallel.devices_per_node
            torch.set_num_threads(cpu_threads(run_cfg.trainer.num_threads, local))
        pl.seed_everything(run_cfg.trainer.seed, workers=True, verbose=False)
        parts, module, datamodule = build_run(run_cfg, self.prepared.parallel, self.run_dir, self.facts)
        if self.role.is_global_zero and parts.diagnostics is not None and parts.diagnostics.on_hang is not None:
            write_report = parts.diagnostics.on_hang

            def on_hang(hang: dict) -> None:
                record_hang(self.failures, hang)
                write_report(hang)

            parts.diagnostics.on_hang = on_hang
        return parts, module, datamodule

    def record(self) -> None:
        """run.json and config.yaml as the run starts (rank 0 writes them; every rank keeps the record)."""
        p = self.prepared
        record_start(
            self.manifest,
            p.resolved_config(),
            p.run_cfg,
            p.parallel,
            self.facts,
            p.checkpoint,
            self.role.attempt,
            self.run_dir,
        )
        if self.role.is_global_zero:
            write_start(self.manifest, self.run_dir)

    def finish(self, parts: TrainerParts, datamodule: pl.LightningDataModule, ranks: LocalRanks | None) -> None:
        """Wait for the local ranks; rank 0 concludes the run (finish.conclude), another rank of a non-finite stop
        leaves its stop marker and ends with its exit code."""
        guard = parts.nonfinite
        stopped = guard is not None and guard.stopped
        failed = ranks.wait() if ranks is not None else []
        if failed and not (stopped and all(code == NONFINITE for _, code in failed)):
            raise RuntimeError(f"local ranks exited with errors: {failed}")
        if not self.role.is_global_zero:
            if stopped and guard is not None:
                # Before the exit: the launcher may see it before its own stop path is done (nan_guard.py).
                write_stop_marker(self.run_dir, self.role.global_rank, guard.stop_reason)
                raise RunStopped(NONFINITE)
            return
        p = self.prepared
        planned = (p.parallel, p.calibration, p.planner_shape)
        conclude(p.run_cfg, parts, datamodule, self.run_dir, self.manifest, self.started, planned)
