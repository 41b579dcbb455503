"""Predicted step time, throughput and utilization from FLOPs, link bandwidths and the overlap each layout allows.

Compute runs at ``Assumptions.compute_efficiency`` of the dense datasheet peak. Communication a strategy can
overlap (FSDP/ZeRO-3 prefetched all-gathers behind forward, gradient reductions behind backward) costs only
what ``Assumptions.comm_overlap`` of that compute window cannot hide; tensor-parallel collectives and pipeline
sends sit on the critical path and are stretched by the pipeline bubble like compute is. The optimizer step
is memory-bound and timed at HBM bandwidth (on the host for offloaded states). Ranks doing the same work drift
apart and a blocking collective right after compute costs more than a warm one (``hw.compute_jitter``,
``hw.sync_overhead_us``, measured by calibration): every blocking collective pays both. Where calibration measured
them, how much of an overlappable collective compute really hides (``hw.comm_overlap``: on a CPU host the
collective's threads need the compute's cores) replaces the assumption, every tensor-parallel (DTensor) module
costs the host ``hw.tp_linear_overhead_us`` per micro-batch on top of its FLOPs, and every FSDP2 unit
``hw.fsdp_unit_overhead_us`` plus ``hw.fsdp_copy_ns_per_byte`` for each byte it copies into or out of its
collective buffers, and every tensor-parallel block a rank holds adds ``hw.tp_step_overhead_us`` to the step's tail
(its DTensor parameters' norm, clipping and AdamW step), every FSDP2-sharded parameter tensor
``hw.fsdp_step_tensor_us`` (and the step ``hw.fsdp_step_fixed_us``), DeepSpeed's ZeRO-1/2 engine its gradient hooks
every micro-batch and its step's host work (``hw.zero_*``: fixed and per byte of the parameters or the partition),
and every step the time its loop spends outside the phases (``hw.loop_overhead_us``: its batches' data wait, the
training loop's hooks, callbacks and logging).

Where the run measured its own parts (one block, the edges, a block's optimizer step: ``planner.measured``), a
layout's forward, backward and optimizer step are composed from them instead of FLOPs over a matmul rate x an
assumed efficiency; communication, waits and the bubble are modelled around them the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diagnostics.calibration import expected_max_of_normals
from diagnostics.mfu import flops_utilization
from disttrain.config.hardware import HardwareProfile
from disttrain.config.schema import PrecisionConfig
from disttrain.planner.bubble import bubble_fraction
from disttrain.planner.links import CommPlan, Sync, link_time
from disttrain.planner.measured import MeasuredParts, parts_basis, parts_compute
from disttrain.planner.shapes import ModelShape, hardware_flops_per_token, model_flops_per_token
from disttrain.planner.spec import Assumptions, Layout, Workload

# An Adam step reads parameter, gradient, momentum and variance and writes parameter, momentum and variance:
# seven state-sized accesses per parameter, bound by HBM bandwidth rather than FLOPs.
ADAM_STEP_ACCESSES = 7


@dataclass(frozen=True)
class StepEstimate:
    step_time_s: float
    compute_s: float  # all micro-batches' forward + backward (+ recomputation) at the achievable rate
    exposed_comm_s: float  # communication compute could not hide, host copies included
    bubble_s: float
    host_optimizer_s: float
    optimizer_step_s: float  # the GPU's own optimizer step over its parameters (HBM-bound)
    sync_wait_s: float  # blocking collectives after compute: waking up, waiting for the group's last rank
    host_dispatch_s: float  # tensor-parallel (DTensor) modules' host overhead beyond their math, all micro-batches
    fsdp_host_s: float  # FSDP2's hooks and buffer copies on the host, all micro-batches
    zero_host_s: float  # DeepSpeed ZeRO-1/2's host work: its gradient hooks (all micro-batches), its step's tail
    loop_s: float  # the step outside its phases: data wait, the training loop's hooks, callbacks and logging
    bubble_fraction: float
    tokens_per_s: float
    mfu: float
    hfu: float
    # Where forward, backward and the optimizer step came from: measured (the run's own parts), scaled (parts of
    # another model or workload, by FLOPs) or flops (FLOPs over the matmul rate x the assumed efficiency).
    compute_basis: str = "flops"
    nvme_s: float = 0.0  # ZeRO-Infinity's reads and writes of swapped states, waited for (at assumptions.nvme_gbps)


@dataclass(frozen=True)
class Utilization:
    mfu: float  # model FLOPs (6N + 12LHQT per token) over peak
    hfu: float  # FLOPs the hardware executed (recomputation included) over peak


def peak_flops(hw: HardwareProfile, precision: str) -> float:
    """Dense peak FLOP/s per device for the precision's matmul dtype; ValueError when the profile has none."""
    dtype = PrecisionConfig(name=precision).compute_dtype
    peak = hw.peak_flops(dtype)
    if peak is None:
        raise ValueError(f"hw profile '{hw.name}' has no peak_tflops for {dtype}")
    return peak


def model_flops(shape: ModelShape, seq_len: int) -> float:
    """Model FLOPs per token of ``shape`` at ``seq_len`` (a measured module's: per sample, as counted)."""
    if shape.flops_per_sample is not None:
        return shape.flops_per_sample
    return model_flops_per_token(shape.matmul_parameters, shape.n_layers, shape.n_heads, shape.head_dim, seq_len)


def mfu_from_throughput(
    tokens_per_s: float,
    flops_per_token: float,
    num_devices: int,
    peak_flops_per_device: float,
    hardware_flops_per_token: float | None = None,
) -> Utilization:
    """The MFU (and HFU) a measured global throughput means: achieved FLOP/s over the devices' peak.

    One implementation for planner and diagnostics (``diagnostics.mfu``): above 100% is an AccountingError.
    """
    executed = flops_per_token if hardware_flops_per_token is None else hardware_flops_per_token
    return Utilization(
        mfu=flops_utilization(tokens_per_s, flops_per_token, num_devices, peak_flops_per_device, "MFU"),
        hfu=flops_utilization(tokens_per_s, executed, num_devices, peak_flops_per_device, "HFU"),
    )


def gpu_optimizer_parameters(shape: ModelShape, layout: Layout) -> int:
    """Parameters whose optimizer step runs on this GPU (offloaded ones step on the host)."""
    return 0 if layout.offload_optimizer else layout.terms.optimizer_parameters(shape, layout)


def optimizer_step_seconds(shape: ModelShape, layout: Layout, workload: Workload, hw: HardwareProfile) -> float:
    """HBM time of the Adam step; 0 when the profile gives no memory bandwidth."""
    if not hw.hbm_bandwidth_gbps:
        return 0.0
    # torch AdamW keeps states in the parameters' dtype: bf16 under bf16-true where it steps them, fp32 otherwise.
    state_bytes = 2 if workload.precision == "bf16-true" and layout.terms.optimizer_states_in_param_dtype else 4
    accessed = ADAM_STEP_ACCESSES * state_bytes * gpu_optimizer_parameters(shape, layout)
    return accessed / (hw.hbm_bandwidth_gbps * 1e9)


def sync_wait_seconds(compute_s: float, syncs: list[Sync], jitter: float | None, overhead_s: float = 0.0) -> float:
    """Seconds a step's blocking collectives cost beyond their bytes and warm latency.

    Each call right after compute pays ``overhead_s`` (a progress thread waking), and waits for its group's last
    rank: each rank's time for the same work drifts like a random walk, ``jitter`` seconds per sqrt(second) of
    compute, so a sync of ``n`` ranks after a segment of ``d`` seconds waits sigma x sqrt(d) x E[max of n normals].
    The syncs split ``compute_s`` into equal segments: k syncs of one group wait sigma x E[max] x sqrt(k x compute),
    so many small syncs (TP's per-layer all-reduces) wait longer than one per step."""
    calls = sum(s.calls for s in syncs if s.group > 1)
    if calls <= 0 or compute_s <= 0:
        return 0.0
    drift = 0.0
    if jitter:
        segment = compute_s / calls
        drift = jitter * math.sqrt(segment) * sum(s.calls * expected_max_of_normals(s.group) for s in syncs)
    return calls * overhead_s + drift


def tp_dispatch_seconds(
    modules: float, overhead_us: float | None, edges: float = 0.0, edge_overhead_us: float | None = None
) -> float:
    """Host seconds per micro-batch that ``modules`` tensor-parallel modules add beyond their math (forward and
    backward), at ``overhead_us`` each (measured by calibration; None: not modelled). Where the model's parallel
    edges were measured as a whole (``edge_overhead_us``), its two edge modules (``edges`` of the model's: 1, or
    1/2 on a pipeline's first or last stage) cost that instead."""
    if edge_overhead_us is None:
        return modules * (overhead_us or 0.0) * 1e-6
    return ((modules - 2 * edges) * (overhead_us or 0.0) + edges * edge_overhead_us) * 1e-6


def tp_step_seconds(blocks: float, overhead_us: float | None) -> float:
    """Host seconds a step's tail (norm, clipping, AdamW) spends on ``blocks`` tensor-parallel blocks' DTensor
    parameters beyond their plain share, at ``overhead_us`` per block (measured; None: not modelled)."""
    return blocks * (overhead_us or 0.0) * 1e-6


def fsdp_step_seconds(tensors: float, hw: HardwareProfile) -> float:
    """Host seconds a step's tail (norm, clipping, AdamW) spends on ``tensors`` FSDP2-sharded parameter tensors beyond
    their plain share: per tensor and once per step, as measured (None: not modelled)."""
    if not tensors:
        return 0.0
    return (tensors * (hw.fsdp_step_tensor_us or 0.0) + (hw.fsdp_step_fixed_us or 0.0)) * 1e-6


def fsdp_host_seconds(units: float, copy_bytes: float, hw: HardwareProfile) -> float:
    """Host seconds per micro-batch FSDP2 adds beyond the math: ``units`` units' hooks and ``copy_bytes`` bytes of
    buffer copies, at the measured per-unit and per-byte costs (None: not modelled)."""
    return units * (hw.fsdp_unit_overhead_us or 0.0) * 1e-6 + copy_bytes * (hw.fsdp_copy_ns_per_byte or 0.0) * 1e-9


def _exposed(comm_s: float, window_s: float, overlap: float) -> float:
    return max(0.0, comm_s - overlap * window_s)


def estimate_step(
    shape: ModelShape,
    layout: Layout,
    workload: Workload,
    hw: HardwareProfile,
    comm: CommPlan,
    assumptions: Assumptions,
    parts: MeasuredParts | None = None,
) -> StepEstimate:
    """Step time of ``layout``: pipelined micro-batches, then what the step itself adds. With ``parts`` (the
    run's measured block, edges and optimizer step) the compute and the optimizer step are composed from them."""
    peak = peak_flops(hw, workload.precision)
    rate = peak * assumptions.compute_efficiency
    seq = workload.seq_len
    model_per_token = model_flops(shape, seq)
    hardware_per_token = hardware_flops_per_token(shape, seq, layout.recompute)
    # Per rank and micro-batch: TP splits every matmul, PP gives each rank 1/p of the layers.
    tokens = workload.micro_batch_size * seq / (layout.tp * layout.pp)
    forward = tokens * model_per_token / 3.0 / rate  # 2N of the 6N; recomputation belongs to backward
    backward = tokens * hardware_per_token / rate - forward
    optimizer = optimizer_step_seconds(shape, layout, workload, hw)
    basis = "flops"
    if parts is not None and parts_basis(parts, shape, workload) is not None:
        measured = parts_compute(parts, shape, layout, workload, gpu_optimizer_parameters(shape, layout))
        forward, backward, optimizer, basis = (
            measured.forward_s,
            measured.backward_s,
            measured.optimizer_step_s,
            measured.basis,
        )
    if layout.tp > 1 and not layout.offload_optimizer:
        optimizer += tp_step_seconds(shape.n_layers / layout.pp, hw.tp_step_overhead_us)
    optimizer += fsdp_step_seconds(comm.step_fsdp_tensors, hw)
    # A measured share (``hw.comm_overlap``, calibration) over the assumption: gloo on a CPU hides ~none of it.
    overlap = assumptions.comm_overlap if hw.comm_overlap is None else hw.comm_overlap
    dispatch = tp_dispatch_seconds(
        comm.mb_tp_modules, hw.tp_linear_overhead_us, comm.mb_tp_edges, hw.tp_edge_overhead_us
    )
    fsdp_host = fsdp_host_seconds(comm.mb_fsdp_units, comm.mb_fsdp_copy_bytes, hw)
    zero_mb, zero_step = layout.terms.engine_host_seconds(shape, layout, workload, hw)

    def seconds(traffic):
        return link_time(traffic, hw, assumptions.host_link_gbps)

    per_mb_exposed = (
        seconds(comm.mb_exposed)
        + _exposed(seconds(comm.mb_fwd), forward, overlap)
        + _exposed(seconds(comm.mb_bwd), backward, overlap)
    )
    m = layout.microbatches
    # Each run of the schedule fills and drains the pipeline once: the bubble is per run, as a fraction.
    bubble = bubble_fraction(layout.schedule, layout.pp, layout.per_schedule, layout.virtual_stages)
    pipeline = m * (forward + backward + dispatch + fsdp_host + zero_mb + per_mb_exposed)
    step_exposed = (
        _exposed(seconds(comm.step_fwd), forward, overlap)
        + _exposed(seconds(comm.step_bwd), backward, overlap)
        + seconds(comm.step_exposed)
    )
    host_optimizer = comm.host_optimizer_parameters / assumptions.cpu_optimizer_params_per_s
    # ZeRO-Infinity's swaps wait for the node's NVMe, which its devices share.
    nvme_bytes = comm.nvme_step_bytes + layout.microbatches * comm.nvme_mb_bytes
    nvme = nvme_bytes * hw.devices_per_node / (assumptions.nvme_gbps * 1e9)
    exposed_share = 1.0 - overlap
    syncs = [Sync(s.group, s.calls * m * (exposed_share if s.hideable else 1.0)) for s in comm.mb_syncs]
    syncs += list(comm.step_syncs)
    overhead = (hw.sync_overhead_us or 0.0) * 1e-6
    sync_wait = sync_wait_seconds(m * (forward + backward), syncs, hw.compute_jitter, overhead)
    loop = (hw.loop_overhead_us or 0.0) * 1e-6
    step = pipeline * (1.0 + bubble) + step_exposed + host_optimizer + nvme + optimizer + zero_step + sync_wait + loop
    tokens_per_s = workload.tokens_per_step / step
    util = mfu_from_throughput(tokens_per_s, model_per_token, layout.world_size, peak, hardware_per_token)
    return StepEstimate(
        step_time_s=step,
        compute_s=m * (forward + backward),
        exposed_comm_s=m * per_mb_exposed + step_exposed,
        bubble_s=pipeline * bubble,
        host_optimizer_s=host_optimizer,
        optimizer_step_s=optimizer,
        nvme_s=nvme,
        sync_wait_s=sync_wait,
        host_dispatch_s=m * dispatch,
        fsdp_host_s=m * fsdp_host,
        zero_host_s=m * zero_mb + zero_step,
        loop_s=loop,
        bubble_fraction=bubble,
        tokens_per_s=tokens_per_s,
        mfu=util.mfu,
        hfu=util.hfu,
        compute_basis=basis,
    )
