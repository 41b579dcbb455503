"""The probes a diagnosed run takes before its first step (and the matmul peak again at its end): the device's
matmul peak and memory bandwidth, the collectives over the run's links, and the run's own layers' host costs under
its parallelism, each written as a telemetry record the planner reads (``python -m plan calibration=RUN_DIR``).

A probe that fails records an ``error`` and is switched off (``guarded``); the link probes run on every rank in the
same order and are not guarded per rank, since a rank that skipped a collective would leave the others waiting.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from diagnostics.collect.calibrate import matmul_flops_per_s, memory_bandwidth_gbps
from diagnostics.collect.calibrate_comm import collective_bandwidth, comm_overlap, sync_wait
from diagnostics.collect.calibrate_parallel import (
    FSDP_PROBE_WIDTHS,
    fsdp_model_overhead,
    fsdp_unit_overhead,
    tp_linear_overhead,
    tp_model_overhead,
)
from diagnostics.collect.fsdp_step import fsdp_step_overhead
from diagnostics.collect.parts import time_model_parts
from diagnostics.collect.run_facts import RunFacts
from diagnostics.collect.zero_step import zero_overhead


class StartupCalibration:
    """One rank's probes: ``write`` records each one, ``guarded`` runs one and switches it off if it fails."""

    def __init__(
        self,
        facts: RunFacts,
        write: Callable[..., None],
        guarded: Callable[[str, Callable[[], Any]], Any],
    ) -> None:
        self.facts = facts
        self.write = write
        self.guarded = guarded
        self.calibrated: float | None = None  # the matmul peak, FLOP/s

    def peak(self, device: torch.device, when: str) -> None:
        """Measure the matmul peak; keep the best of start and end (load from other processes only lowers it)."""
        result = self.guarded("calibration", lambda: matmul_flops_per_s(device, self.facts.compute_dtype))
        if result:
            self.calibrated = max(self.calibrated or 0.0, result["flops_per_s"])
            self.write("calibration", when=when, **result)

    def parts(self, device: torch.device) -> None:
        """Time the run's own block, edges and block optimizer step (what the planner composes each layout's step
        from). Per rank, no collectives: a rank whose probe fails records the error and the others go on."""
        f = self.facts
        if f.parts_probe is None:
            return
        probe = f.parts_probe
        result = self.guarded("parts_calibration", lambda: time_model_parts(device, probe(device), f.micro_batch_size))
        if result:
            self.write("parts_calibration", precision=f.precision, **result)

    def links(self, trainer: pl.Trainer, device: torch.device) -> None:
        """Bus bandwidth of each collective over the run's links, and this device's memory bandwidth: what the
        planner divides by (``python -m plan calibration=RUN_DIR``). Every rank takes part in the same order; not
        guarded per rank, since a rank that skipped a collective would leave the others waiting in it."""
        import torch.distributed as dist

        bandwidth = self.guarded("memory_calibration", lambda: memory_bandwidth_gbps(device))
        if bandwidth:
            self.write("memory_calibration", bandwidth_gbps=bandwidth)
        if not dist.is_available() or not dist.is_initialized() or trainer.world_size < 2:
            return
        nbytes = (256 if device.type == "cuda" else 8) * 2**20
        groups: list[tuple[str, object | None]] = [("inter_node" if trainer.num_nodes > 1 else "intra_node", None)]
        if trainer.num_nodes > 1 and trainer.num_devices > 1:
            local, _ = dist.new_subgroups(group_size=trainer.num_devices)
            groups.append(("intra_node", local))
        ops = ["all_reduce", "all_gather", "reduce_scatter"]
        if self.facts.tp > 1:  # DTensor's activation collectives: the functional all-reduce (see calibrate)
            ops.append("functional_all_reduce")
        for link, group in groups:
            for op in ops:
                self.write("link_calibration", link=link, **collective_bandwidth(op, group, nbytes, device))
        self.write("sync_calibration", **sync_wait(None, device))
        self.write("overlap_calibration", **comm_overlap(None, nbytes, device, trainer.num_devices))
        if self.facts.tp > 1:  # the only runs with DTensor tensor parallelism (0.2-0.8 s on 2 CPU ranks)
            f = self.facts
            # Probes at the run's shapes build layers and activations beside the model: on a GPU that memory may be
            # what the run needs, and the host cost they measure hides behind the kernels there (tiny pair only).
            on_cpu = device.type == "cpu"
            if f.tp_probe is not None and on_cpu:
                parts = functools.partial(f.tp_probe, device=device)
                self.write("tp_calibration", **tp_model_overhead(device, f.tp, parts, f.micro_batch_size))
            else:
                shapes = {"tokens": f.micro_batch_size * f.seq_len, "width": f.d_model} if f.d_model and on_cpu else {}
                self.write("tp_calibration", **tp_linear_overhead(device, f.tp, **shapes))
        if self.facts.fsdp_shard_ranks:  # 0.1-0.3 s on 2 CPU ranks, and 0.2-0.4 s for the step tail
            ranks, step_tail = self.facts.fsdp_shard_ranks, self.facts.step_tail
            # The run's own model at its micro-batch (0.5-1.5 s on 2 CPU ranks) on a CPU only: on a GPU its copy
            # would take memory the run may need, and the host work hides behind the kernels there.
            own_model = self.facts.fsdp_probe if device.type == "cpu" else None
            record = fsdp_unit_overhead(device, ranks, widths=FSDP_PROBE_WIDTHS[:1] if own_model else FSDP_PROBE_WIDTHS)
            if own_model is not None:
                parts = functools.partial(own_model, device=device)
                mb = self.facts.micro_batch_size
                # A model the probe cannot copy fails alike on every rank, in its build or first plain pass (before
                # any collective): all ranks then time the Linear pair's per-byte width instead, as before.
                measured = self.guarded(
                    "fsdp_model_calibration", lambda: fsdp_model_overhead(device, ranks, parts, mb, record["fixed_us"])
                )
                record.update(measured or fsdp_unit_overhead(device, ranks))
            if step_tail is not None:
                record.update(fsdp_step_overhead(device, ranks, step_tail))
            self.write("fsdp_calibration", **record)
        zero_probe, step_tail = self.facts.zero_probe, self.facts.step_tail
        if zero_probe is not None and step_tail is not None and device.type == "cpu":
            # DeepSpeed's host work on a copy of the run's model (1-2 s on 2 CPU ranks), on a CPU only (on a GPU the
            # copy would take memory the run may need, and the host work hides behind the kernels). A model the probe
            # cannot build fails alike on every rank, before its engine's first collective.
            parts = functools.partial(zero_probe, device=device)
            mb, world = self.facts.micro_batch_size, trainer.world_size
            zero = self.guarded("zero_calibration", lambda: zero_overhead(device, parts, step_tail, mb, world))
            if zero:
                self.write("zero_calibration", **zero)
