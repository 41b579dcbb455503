"""The telemetry contract between collection (inside training) and analysis (anywhere, later).

Each rank appends JSON lines to ``RUN_DIR/telemetry/rank<NNNN>.jsonl``; every line is one record with a
``kind`` and the fields listed in ``RECORD_FIELDS`` (extra fields are allowed and ignored by readers that do
not know them). Pure Python on purpose: ``python -m diagnose`` reads a run directory copied from a cluster
on a laptop, without torch or a GPU.

Record kinds (all carry ``kind``, ``rank`` and ``t``, a unix time in seconds):

- ``meta``: once per rank at start. What ran: world layout, device, which sampler was available, the
  FLOPs accounting and the peaks MFU is measured against; ``cpu_count`` and ``num_threads`` (torch threads
  per rank) say whether the compute already fills the host's cores.
- ``step``: per optimizer step (or every ``step_every`` steps). Wall time of the step and its phases as seen
  by this rank. ``data_wait_s`` is time inside ``next(dataloader)``; ``local_compute_s`` is forward +
  backward + optimizer work timed *without* waiting for other ranks; ``comm_wait_s`` is the part of backward
  after this rank's gradients were ready (exposed all-reduce, and waiting for slower ranks); ``other_s`` is
  the rest of the step (hooks, logging, checkpoint writes). ``start_t`` is the unix time the step started on
  this rank's host: with the phases it orders the ranks' arrivals (who fell behind in which phase).
- ``ranks``: written by rank 0 every few steps from a tiny all-gather: per-rank lists (index = rank) of the
  mean local compute, step time and data wait over the last window. DDP equalizes step times, so this is
  where a straggler shows.
- ``sample``: periodic device sample from NVML (``source="nvml"``) or the CPU fallback (``source="cpu"``).
- ``profile``: one torch.profiler window per rank parsed into communication, computation, their overlap and
  idle time, and the payload bytes handed to collectives per step (``comm_bytes_per_step``, by op).
- ``memory``: peak memory at the end (GPU allocator peaks, or RSS on CPU), and the training state this rank holds
  (parameters, gradients, optimizer states; diagnostics/collect/state_bytes.py).
- ``throughput``: the run's tokens/s, MFU and HFU against each peak.
- ``calibration``: the measured matmul FLOP/s of this device, at the ``start`` and the ``end`` of training; the
  calibrated peak is the larger (other processes' load on a shared host only ever lowers a measurement).
- ``link_calibration``: at start-up, one collective (all-reduce, all-gather, reduce-scatter) timed over the run's
  ``intra_node`` or ``inter_node`` group, with nccl-tests' algorithm and bus bandwidths (GB/s) and the latency of
  a one-element-per-rank call (microseconds).
- ``memory_calibration``: at start-up, this device's streaming memory bandwidth (GB/s of ``a = b + c``).
- ``sync_calibration``: at start-up, over the world: the mean time of a fixed matmul segment, this rank's wait in
  the one-element all-reduce after it in each round (and their mean), with the call's warm latency (what a
  blocking collective costs after compute, and how far ranks drift apart).
- ``error``: a collector failed; training went on.
- ``hang``: the watchdog fired: no step completed within the timeout.
- ``nonfinite``: a step had a non-finite loss or gradient (``what``); ``action`` is ``skipped`` (its update was
  dropped, ``skipped_total`` so far) or ``stopped`` (``trainer.nan_policy``).
- ``expert_layout``: once, mixture-of-experts models only: experts, top-k, the ``ep`` degree, the experts this rank
  computes (``first_expert``, ``num_local``: its first slot and how many; ``placement``: per layer, the expert each
  slot holds, null where slot = expert id), capacity factor, balancing weight, routed FLOPs per token.
- ``experts``: every optimizer step, MoE models only: per layer and expert, the assignments this rank's tokens were
  routed to (``routed``) and those dropped over capacity (``dropped``).
- ``end``: the rank finished cleanly; ``collectors_s`` is the time the always-on collectors took on the training
  thread over the whole run (their direct cost; the profiler window is not included).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

TELEMETRY_DIR = "telemetry"

RECORD_FIELDS: dict[str, tuple[str, ...]] = {
    "meta": (
        "world_size", "local_rank", "hostname", "pid", "cpu_count", "num_threads", "host_memory_bytes", "device",
        "sampler", "strategy", "precision", "hw",
        "compute_dtype", "num_parameters", "flops_per_token", "hardware_flops_per_token", "tokens_per_step",
        "micro_batch_size", "accumulation", "seq_len", "peak_flops", "peak_flops_source", "max_steps",
        "work_unit", "tokens_per_sample",
    ),
    "step": (
        "step", "step_s", "data_wait_s", "forward_s", "backward_s", "optimizer_s", "local_compute_s",
        "comm_wait_s", "other_s", "tokens", "start_t",
    ),
    "ranks": ("step", "window_steps", "local_compute_s", "step_s", "data_wait_s"),
    "sample": (
        "source", "device_index", "util_pct", "mem_used_bytes", "mem_total_bytes", "power_w", "sm_clock_mhz",
        "temp_c", "throttle_reasons", "nvlink_tx_bytes_per_s", "nvlink_rx_bytes_per_s", "pcie_tx_bytes_per_s",
        "pcie_rx_bytes_per_s", "cpu_util_pct", "rss_bytes",
    ),
    "profile": (
        "steps", "total_s", "compute_s", "comm_s", "overlap_s", "idle_s", "comm_by_op", "trace_file", "backend",
        "comm_bytes_per_step", "comm_bytes_by_op",
    ),
    "memory": (
        "peak_allocated_bytes", "peak_reserved_bytes", "peak_rss_bytes", "device_memory_bytes", "training_state_bytes",
    ),
    "throughput": (
        "tokens_per_s", "mfu", "hfu", "calibrated_mfu", "calibrated_hfu", "peak_flops", "calibrated_peak_flops",
        "steps_measured",
    ),
    "calibration": ("when", "dtype", "matrix_size", "flops_per_s", "seconds"),
    # a LightningModule's FLOPs per unit of work counted at its first step (training/flop_count.py)
    "flops_count": ("flops_per_unit", "source"),
    "link_calibration": ("link", "op", "ranks", "bytes", "seconds", "algbw_gbps", "busbw_gbps", "latency_us"),
    "memory_calibration": ("bandwidth_gbps",),
    "sync_calibration": ("ranks", "rounds", "segment_s", "wait_s", "waits_s", "latency_s"),
    "overlap_calibration": ("method", "hidden"),  # spare_cores: cores, local_ranks, threads; probe: *_s
    # probe "pair": *_pair_s; probe "model": *_block_s, *_edges_s, modules_per_block, edge_overhead_us
    "tp_calibration": ("probe", "ranks", "tokens", "width", "collective_s", "overhead_us"),
    "fsdp_calibration": ("ranks", "overhead_s", "unit_numel", "fixed_us", "ns_per_byte"),
    # what DeepSpeed's ZeRO-1/2 engine adds on the host, per micro-batch and per step (collect/zero_step.py)
    "zero_calibration": (
        "dp", "accumulation", "param_bytes", "backward_fixed_us", "backward_ns_per_byte", "step_fixed_us",
        "step_ns_per_byte",
    ),
    # the run's own block, edges and a block's optimizer step at its micro-batch and precision (collect/parts.py)
    "parts_calibration": (
        "precision", "micro_batch", "seq_len", "d_model", "vocab_size", "block_numel", "block_forward_s",
        "block_backward_s", "edges_forward_s", "edges_backward_s", "optimizer_step_s", "wall_s",
    ),
    "error": ("source", "message"),
    "hang": ("last_step", "timeout_s", "stacks_dir", "in_collective", "waiting_on_loader"),
    "nonfinite": ("step", "what", "action", "skipped_total"),
    "expert_layout": (
        "layers", "num_experts", "top_k", "ep", "first_expert", "num_local", "capacity_factor", "aux_loss_coef",
        "aux_loss_key", "capacity_key", "routed_flops_per_token", "layer_ids", "placement",
    ),
    "experts": ("step", "routed", "dropped"),
    "pause": ("what", "step", "seconds", "start_t"),  # validation or a checkpoint write (collect/steps.Pause)
    "end": ("steps", "wall_s", "collectors_s"),
}  # fmt: skip


def telemetry_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / TELEMETRY_DIR / f"rank{rank:04d}.jsonl"


class TelemetryWriter:
    """Append-only JSON-lines writer for one rank; line-buffered so a crash loses at most one record."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.rank = rank
        self.path = telemetry_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1, encoding="utf-8")
        # A write the disk refused (full, gone, read-only): later records are dropped. The run's failure path names
        # the cause once; a telemetry error raised from every hook after it would bury that line in tracebacks.
        self.failed: OSError | None = None

    def write(self, kind: str, **fields: Any) -> None:
        if kind not in RECORD_FIELDS:
            raise ValueError(f"unknown telemetry record kind {kind!r}")
        if self.failed is not None:
            return
        record = {"kind": kind, "rank": self.rank, "t": time.time(), **fields}
        try:
            self._file.write(json.dumps(record, default=_jsonable) + "\n")
        except OSError as err:
            self.failed = err

    def flush(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            try:
                self._file.close()
            except OSError as err:  # the buffered tail on a full disk
                self.failed = self.failed or err


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, set | tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
