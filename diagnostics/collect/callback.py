"""The Lightning callback that runs every collector and writes this rank's telemetry.

A collector that fails writes an ``error`` record and is switched off; training is never interrupted by
diagnostics. The only collective here (the per-rank all-gather) runs at the same optimizer step on every
rank, so it cannot deadlock a healthy run.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from diagnostics.analysis.live import DEVICE_FIELDS, RanksWindow
from diagnostics.collect.deepspeed_comm import time_deepspeed_collectives
from diagnostics.collect.experts import (
    exchanges_tokens,
    expert_layers,
    expert_layout,
    take_expert_load,
    time_expert_collectives,
)
from diagnostics.collect.fsdp_comm import time_fsdp_collectives
from diagnostics.collect.lightning_comm import time_lightning_collectives
from diagnostics.collect.module_timing import ModuleTiming
from diagnostics.collect.profile_window import ProfilerWindow
from diagnostics.collect.run_facts import CollectSettings, RunFacts
from diagnostics.collect.sampler import DeviceSampler, make_reader, rss_bytes
from diagnostics.collect.startup_calibration import StartupCalibration
from diagnostics.collect.state_bytes import training_state_bytes
from diagnostics.collect.steps import DataWaitProfiler, PhaseTimer, StepPhases
from diagnostics.collect.watchdog import Watchdog
from diagnostics.mfu import flops_utilization
from diagnostics.telemetry import TelemetryWriter


def _run_rng_kept(device: torch.device) -> contextlib.AbstractContextManager:
    """torch's CPU generator (and ``device``'s, on a GPU) restored on exit."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


class DiagnosticsCallback(pl.Callback):
    def __init__(
        self,
        settings: CollectSettings,
        facts: RunFacts,
        run_dir: Path,
        tokens_per_s: Callable[[], float | None],
        on_hang: Callable[[dict], None] | None = None,
    ) -> None:
        self.settings = settings
        self.facts = facts
        self.run_dir = Path(run_dir)
        self.tokens_per_s = tokens_per_s
        self.on_hang = on_hang
        self.writer: TelemetryWriter | None = None
        self.timer = PhaseTimer()
        self.window: list[StepPhases] = []
        # Handed to the Trainer as `profiler=`: Lightning times each training next(dataloader) through it.
        self.data_wait = DataWaitProfiler()
        self.data_wait.timer = self.timer
        self.sampler: DeviceSampler | None = None
        self.profiler: ProfilerWindow | None = None
        self.watchdog: Watchdog | None = None
        self.calibration = StartupCalibration(facts, self.write, self.guarded)
        self.training_state: int | None = None  # bytes of parameters, gradients and optimizer states (once)
        self.steps_seen = 0
        # Seconds the always-on collectors spent on the training thread (hooks, records, rank gathers): their
        # direct cost, which an A/B of whole runs on a shared machine measures only through its noise.
        self.own_s = 0.0
        self._last_step = -1
        self.module_timing = ModuleTiming(facts, settings.calibrate)  # a user's module timed after training
        # FSDP2's and DeepSpeed's collectives are timed per phase (collect/fsdp_comm, collect/deepspeed_comm).
        self.times_collectives = False
        self.times_all_to_all = False  # and expert parallelism's all-to-alls, apart (collect/experts)
        self._untime_deepspeed: Callable[[], None] | None = None
        self._untime_lightning: Callable[[], None] | None = None  # a LightningModule's strategy.reduce timed
        self.expert_layers: list[Any] = []  # a mixture-of-experts model's layers, whose load is read every step
        self._disabled: set[str] = set()
        # For the user's logger (disttrain.training.live_metrics), on rank 0 only: its steps since the logger last
        # took them (bounded: a logger that never takes them costs a fixed few hundred kB), the last two gathers,
        # and the run's final throughput record.
        self.recent: deque[StepPhases] = deque(maxlen=10_000)
        self.rank_windows: deque[RanksWindow] = deque(maxlen=2)
        self.final_throughput: dict[str, Any] | None = None

    # -- plumbing -------------------------------------------------------------------------------------------
    def write(self, kind: str, **fields: Any) -> None:
        if self.writer is not None:
            self.writer.write(kind, **fields)

    def guarded(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run one collector step; on failure record it once and switch that collector off."""
        if name in self._disabled:
            return None
        try:
            return fn()
        except Exception as err:
            self._disabled.add(name)
            self.write("error", source=name, message=f"{type(err).__name__}: {err}")
            return None

    # -- start ----------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.writer is not None:
            return
        self.writer = TelemetryWriter(self.run_dir, trainer.global_rank)
        device = pl_module.device if pl_module.device.type != "meta" else torch.device("cpu")
        reader, why = make_reader(device.index or 0 if device.type == "cuda" else None)
        if why:
            self.write("error", source="sampler", message=why)
        f = self.facts
        self.write(
            "meta",
            world_size=trainer.world_size,
            local_rank=trainer.local_rank,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            cpu_count=os.cpu_count(),
            num_threads=torch.get_num_threads(),  # with cpu_count and ranks per host: are the cores all busy?
            host_memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            device=str(device),
            sampler=reader.source,  # type: ignore[attr-defined]
            strategy=f.strategy,
            precision=f.precision,
            hw=f.hw,
            compute_dtype=f.compute_dtype,
            num_parameters=f.num_parameters,
            flops_per_token=f.flops_per_token,
            hardware_flops_per_token=f.hardware_flops_per_token,
            tokens_per_step=f.tokens_per_step,
            work_unit=f.work_unit,
            tokens_per_sample=f.tokens_per_sample,
            micro_batch_size=f.micro_batch_size,
            accumulation=f.accumulation,
            seq_len=f.seq_len,
            peak_flops=f.peak_flops,
            peak_flops_source="datasheet" if f.peak_flops else None,
            max_steps=f.max_steps,
        )
        if self.settings.calibrate:
            # The probes seed and draw from torch's generators: the run's own streams (dropout, its data) must come
            # out as they went in, or switching diagnostics on (or changing a probe) would change the training.
            with _run_rng_kept(device):
                self.calibrate(device, "start")
                self.calibrate_links(trainer, device)
                # After the links' barriers: every rank times its parts at once, as every rank computes in a step
                # (on a host whose cores the ranks share, a rank probing alone would see a core to itself).
                self.calibrate_parts(device)
        self.sampler = DeviceSampler(reader, self.write, self.settings.sample_interval_s)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        wrapped = self.guarded("fsdp_comm", lambda: time_fsdp_collectives(pl_module, self.timer.collective_ran))
        if self.facts.strategy == "deepspeed":
            self._untime_deepspeed = self.guarded(
                "deepspeed_comm", lambda: time_deepspeed_collectives(self.timer.collective_ran)
            )
        self.expert_layers = self.guarded("experts", lambda: expert_layers(pl_module)) or []
        observed = 0
        if self.expert_layers:
            self.guarded("experts", lambda: self.write("expert_layout", **expert_layout(self.expert_layers)))
            layers = self.expert_layers
            observed = self.guarded(
                "expert_comm", lambda: time_expert_collectives(layers, self.timer.model_collective_ran)
            )
            self.times_all_to_all = bool(observed) and exchanges_tokens(layers)
        if self.facts.work_unit == "sample":  # a user's LightningModule: its sync_dist logging reduces in forward
            self._untime_lightning = self.guarded(
                "lightning_comm", lambda: time_lightning_collectives(trainer.strategy, self.timer.collective_ran)
            )
        timed = (self._untime_deepspeed, self._untime_lightning)
        self.times_collectives = bool(wrapped) or any(undo is not None for undo in timed) or bool(observed)
        if self.sampler is not None:
            self.sampler.start()
        if self.settings.profile:
            self.profiler = self.guarded(
                "profiler",
                lambda: ProfilerWindow(
                    self.settings.profile_wait_steps,
                    self.settings.profile_active_steps,
                    self.run_dir / "traces",
                    trainer.global_rank,
                    self.write,
                    use_cuda=pl_module.device.type == "cuda",
                    all_threads=self.facts.collectives_off_thread,
                ),
            )
        self.watchdog = Watchdog(
            self.settings.hang_timeout_s,
            self.run_dir,
            trainer.global_rank,
            trainer.local_rank,
            self.write,
            on_fire=self.on_hang,
        )
        self.watchdog.beat(trainer.global_step)
        self.watchdog.start()

    def _mark_backward_compute_end(self, loss: torch.Tensor) -> None:
        """Mark the end of this rank's backward compute: a callback autograd runs when the graph's last gradient
        has been computed, queued from the loss's own gradient hook (the first thing backward computes).

        Queued that early, it runs before the callbacks DDP (its final wait for the bucket all-reduces) and FSDP2
        (its last reduce-scatter) queue later in the same backward, so what follows it is comm wait, whatever the
        model: a parameter's or a module's hook marks the end only where that parameter happens to be the last one
        autograd reaches (a user model holding its position table as a root parameter had the logits' gradient,
        the start of backward, taken for the end, and every rank's backward read as waiting).
        """
        if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
            return
        engine = torch.autograd.Variable._execution_engine

        def queue_mark(grad: torch.Tensor) -> torch.Tensor:
            engine.queue_callback(lambda: self.timed(self.timer.grad_ready))
            return grad

        loss.register_hook(queue_mark)

    def timed(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, its time counted as the collectors' own (the user's-logger callback counts itself here too)."""
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self.own_s += time.perf_counter() - start

    # -- per step -------------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        self.module_timing.batch_started(batch)
        self.timed(self.timer.batch_start)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.timed(self.timer.before_backward)
        self.guarded("grad_hook", lambda: self._mark_backward_compute_end(loss))

    def on_after_backward(self, *args: Any) -> None:
        self.timed(self.timer.after_backward)

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.timed(self.timer.before_optimizer_step)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # A module whose engine runs the step's micro-batches itself (Megatron's pipeline schedule) times them.
        pop_timing = getattr(pl_module, "pop_schedule_timing", None)
        timing = pop_timing() if callable(pop_timing) else None
        if timing is not None:
            self.timed(
                lambda: self.timer.schedule_ran(timing.forward_s, timing.backward_s, timing.wall_s, timing.pipelined)
            )
        step = trainer.global_step
        if step == self._last_step:  # a micro-batch inside gradient accumulation
            self.timed(self.timer.batch_end)
            return
        self._last_step = step
        if self.expert_layers:  # every step: the counters hold this step's load only
            self.guarded("experts", lambda: self.write("experts", step=step, **take_expert_load(self.expert_layers)))
        if self.training_state is None and step >= 2:
            # Once, right after an optimizer step: gradients and optimizer states all exist (the next step's
            # zero_grad frees the gradients; at train end they may be gone).
            self.training_state = self.guarded(
                "training_state", lambda: training_state_bytes(pl_module, trainer.optimizers)
            )
        phases = self.timed(self.timer.finish_step)
        self._record_pauses(trainer)
        if self.watchdog is not None:
            self.watchdog.beat(step)
        if self.profiler is not None:  # the one-time window: its cost is measured on its own (benchmarks/)
            self.guarded("profiler", self.profiler.step)
        if phases is not None:
            self.timed(lambda: self._record_step(trainer, step, phases))

    def take_recent(self) -> list[StepPhases]:
        """Rank 0's steps recorded since the last call (the logger's window)."""
        taken = list(self.recent)
        self.recent.clear()
        return taken

    def _record_step(self, trainer: pl.Trainer, step: int, phases: StepPhases) -> None:
        self.steps_seen += 1
        self.window.append(phases)
        if trainer.is_global_zero:
            self.recent.append(phases)
        if step % self.settings.step_every == 0:
            self.write(
                "step",
                step=step,
                step_s=phases.step_s,
                start_t=phases.start_t,
                data_wait_s=phases.data_wait_s,
                data_cpu_s=phases.data_cpu_s,
                forward_s=phases.forward_s,
                backward_s=phases.backward_s,
                optimizer_s=phases.optimizer_s,
                local_compute_s=phases.local_compute_s,
                comm_wait_s=phases.comm_wait_s,
                other_s=phases.other_s,
                tokens=self.facts.tokens_per_step,
                **({"bubble_fraction": phases.bubble_fraction} if phases.pipelined else {}),
                **(
                    {
                        "forward_comm_s": phases.forward_comm_s,
                        "backward_comm_s": phases.backward_comm_s,
                        "optimizer_comm_s": phases.optimizer_comm_s,
                    }
                    if self.times_collectives and phases.phase_comm_known
                    else {}
                ),
                **(
                    {"comm_calls_s": [round(c, 6) for c in phases.comm_calls_s]}
                    if self.times_collectives and phases.phase_comm_known
                    else {}
                ),
                **(
                    {
                        "all_to_all_s": phases.all_to_all_s,
                        "all_to_all_calls_s": [round(c, 6) for c in phases.all_to_all_calls_s],
                        "all_to_all_after_experts": phases.all_to_all_after_experts,
                    }
                    if self.times_all_to_all and phases.phase_comm_known
                    else {}
                ),
            )
        if step % self.settings.gather_every == 0:
            self.guarded("rank_gather", lambda: self._gather(trainer, step))

    def _gather(self, trainer: pl.Trainer, step: int) -> None:
        """All-gather a few floats per rank: the window's mean local compute, step time, data wait and comm wait
        (the last for the logger's exposed-communication and waiting shares), its node and its device's newest
        NVML reading (for the logger's per-node GPU figures), all riding in the one collective."""
        n = max(1, len(self.window))
        sample = self.sampler.latest if self.sampler is not None else None
        nvml = sample if sample and sample.get("source") == "nvml" else {}
        nan = float("nan")
        device = [float(v) if (v := nvml.get(f)) is not None else nan for f in DEVICE_FIELDS]
        local = torch.tensor(
            [
                sum(p.local_compute_s for p in self.window) / n,
                sum(p.step_s for p in self.window) / n,
                sum(p.data_wait_s for p in self.window) / n,
                sum(p.comm_wait_s for p in self.window) / n,
                float(trainer.node_rank),
                *device,
            ],
            dtype=torch.float64,
            device=trainer.strategy.root_device,
        )
        width = local.numel()
        gathered = trainer.strategy.all_gather(local).reshape(-1, width).cpu().tolist()
        if trainer.is_global_zero:
            columns = [[row[i] for row in gathered] for i in range(width)]
            self.write(
                "ranks",
                step=step,
                window_steps=len(self.window),
                local_compute_s=columns[0],
                step_s=columns[1],
                data_wait_s=columns[2],
                comm_wait_s=columns[3],
            )
            devices = [dict(zip(DEVICE_FIELDS, row[5:], strict=True)) for row in gathered]
            nodes = [int(v) for v in columns[4]]
            self.rank_windows.append(
                RanksWindow(step, columns[1], columns[0], columns[2], columns[3], node=nodes, device=devices)
            )
        self.window = []

    def on_validation_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.sanity_checking:
            return
        self.timer.pause_ended()  # a checkpoint written between steps ended where validation starts
        self.timer.pause_started("validation")
        if self.watchdog is not None:
            self.watchdog.beat(self._last_step)

    def on_validation_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.sanity_checking:
            return
        self.timer.pause_ended()
        self._record_pauses(trainer)
        # Validation is not part of a training step: restart the step clock after it.
        self.timer.reset_clock()
        if self.watchdog is not None:
            self.watchdog.beat(self._last_step)

    def on_save_checkpoint(self, *args: Any) -> None:
        # The write follows this hook; this callback's next step end, data fetch or batch start ends it.
        self.timer.pause_started("checkpoint")
        if self.watchdog is not None:
            self.watchdog.beat(self._last_step)

    def _record_pauses(self, trainer: pl.Trainer) -> None:
        """Write the pauses that ended (what, seconds, start): the analysis' share of the loop spent outside steps."""
        for pause in self.timer.take_pauses():
            self.write("pause", what=pause.what, step=trainer.global_step, seconds=pause.seconds, start_t=pause.start_t)

    # -- end ------------------------------------------------------------------------------------------------
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.timer.pause_ended()
        self._record_pauses(trainer)
        self.teardown_collectors()
        self.module_timing.run(trainer, pl_module, self.guarded, self.write)
        memory: dict[str, Any] = {"peak_rss_bytes": rss_bytes()}
        if self.training_state:
            memory["training_state_bytes"] = self.training_state
        if pl_module.device.type == "cuda":
            memory.update(
                peak_allocated_bytes=torch.cuda.max_memory_allocated(pl_module.device),
                peak_reserved_bytes=torch.cuda.max_memory_reserved(pl_module.device),
                device_memory_bytes=torch.cuda.get_device_properties(pl_module.device).total_memory,
            )
        self.write("memory", **memory)
        if self.settings.calibrate:
            self.calibrate(pl_module.device, "end")
        if self.facts.counted_flops_per_unit is not None and (counted := self.facts.counted_flops_per_unit()):
            self.write("flops_count", flops_per_unit=counted, source="FlopCounterMode over the first micro-batch")
        tokens_per_s = self.tokens_per_s()
        if tokens_per_s:
            self.guarded("throughput", lambda: self._throughput(trainer.world_size, tokens_per_s))
        self.write("end", steps=trainer.global_step, wall_s=None, collectors_s=self.own_s)
        if self.writer is not None:
            self.writer.flush()

    def calibrate(self, device: torch.device, when: str) -> None:
        self.calibration.peak(device, when)

    def calibrate_parts(self, device: torch.device) -> None:
        self.calibration.parts(device)

    def calibrate_links(self, trainer: pl.Trainer, device: torch.device) -> None:
        self.calibration.links(trainer, device)

    @property
    def calibrated(self) -> float | None:
        """The calibrated matmul peak (FLOP/s) of this device, the best of start and end; None before it ran."""
        return self.calibration.calibrated

    def _throughput(self, world_size: int, tokens_per_s: float) -> None:
        f = self.facts

        def ratio(flops_per_token: float, peak: float | None, what: str) -> float | None:
            return None if not peak else flops_utilization(tokens_per_s, flops_per_token, world_size, peak, what)

        flops, hardware = self.flops_per_unit, self.hardware_flops_per_unit
        self.final_throughput = dict(
            tokens_per_s=tokens_per_s,
            mfu=ratio(flops, f.peak_flops, "MFU") if flops else None,
            hfu=ratio(hardware, f.peak_flops, "HFU") if hardware else None,
            calibrated_mfu=ratio(flops, self.calibrated, "calibrated MFU") if flops else None,
            calibrated_hfu=ratio(hardware, self.calibrated, "calibrated HFU") if hardware else None,
            peak_flops=f.peak_flops,
            calibrated_peak_flops=self.calibrated,
            steps_measured=self.steps_seen,
        )
        self.write("throughput", **self.final_throughput)

    @property
    def flops_per_unit(self) -> float:
        """Model FLOPs per unit of work: the model's own figure, else the first step's count (0 before it)."""
        counted = self.facts.counted_flops_per_unit
        return self.facts.flops_per_token or (counted() or 0.0 if counted is not None else 0.0)

    @property
    def hardware_flops_per_unit(self) -> float:
        return self.facts.hardware_flops_per_token or self.flops_per_unit

    def teardown_collectors(self) -> None:
        if self._untime_deepspeed is not None:
            self._untime_deepspeed()
            self._untime_deepspeed = None
        if self._untime_lightning is not None:
            self._untime_lightning()
            self._untime_lightning = None
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.sampler is not None and self.sampler.is_alive():
            self.sampler.stop()
        if self.profiler is not None:
            self.guarded("profiler", self.profiler.close)
            self.profiler = None

    def crash_site(self, trainer: pl.Trainer) -> tuple[int, str]:
        """(step, phase) this rank is in, for its crash record; steps are numbered as the step records are
        (the n-th optimizer step), so a step that had not finished is the one after ``global_step``."""
        phase = self.timer.phase
        in_step = phase in ("data", "forward", "backward", "optimizer")
        return trainer.global_step + (1 if in_step else 0), phase

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.teardown_collectors()
        self.write("error", source="training", message=f"{type(exception).__name__}: {exception}")
        if self.writer is not None:
            self.writer.flush()
