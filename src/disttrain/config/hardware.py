"""Hardware profiles (``conf/hw``): what a run's machines are.

A profile is pure data (from ``conf/hw/*.yaml``). Peaks are *dense* FLOP/s (not the 2x structured-sparsity
datasheet figures); each YAML cites its datasheet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain.config.errors import ConfigError

ACCELERATORS = ("cpu", "gpu")
LINK_NAMES = ("intra_node", "inter_node")
# functional_all_reduce: the out-of-place all-reduce DTensor's tensor parallelism issues (its own cost on gloo).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "functional_all_reduce")
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
# The profile's host and sync figures a run's calibration measures, each a field of the same name in
# ``diagnostics.calibration.Calibration`` that replaces the profile's where it was taken (planner/calibrated.py).
CALIBRATED_SCALARS = (
    "sync_overhead_us",
    "compute_jitter",
    "comm_overlap",
    "tp_linear_overhead_us",
    "tp_edge_overhead_us",
    "tp_step_overhead_us",
    "fsdp_unit_overhead_us",
    "fsdp_copy_ns_per_byte",
    "fsdp_step_tensor_us",
    "fsdp_step_fixed_us",
    "zero_backward_fixed_us",
    "zero_backward_ns_per_byte",
    "zero_step_fixed_us",
    "zero_step_ns_per_byte",
    "loop_overhead_us",
)


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    accelerator: str  # cpu | gpu
    num_nodes: int
    devices_per_node: int  # GPUs per node; on CPU, training processes per node
    device_type: str = "cpu"  # e.g. a100-sxm4-80gb; informational
    memory_per_device_gib: float | None = None  # None on CPU: host memory is shared by the processes
    peak_tflops: dict[str, float] = field(default_factory=dict)  # dense, per device, by dtype
    hbm_bandwidth_gbps: float | None = None  # GB/s per device
    intra_node_link: str = "none"  # nvlink | pcie | shm
    intra_node_bandwidth_gbps: float | None = None  # GB/s per device, one direction
    inter_node_bandwidth_gbps: float | None = None  # GB/s per node, one direction
    # Seconds every collective call costs on top of its bytes (None: not modelled); calibration measures them.
    intra_node_latency_us: float | None = None
    inter_node_latency_us: float | None = None
    # Per collective, keyed ``<link>.<op>`` (e.g. ``intra_node.all_gather``): bus bandwidth (nccl-tests convention)
    # and per-call latency where they differ from the link's figures above; calibration measures them.
    collective_busbw_gbps: dict[str, float] = field(default_factory=dict)
    collective_latency_us: dict[str, float] = field(default_factory=dict)
    # Blocking collectives right after compute (TP's activation all-reduces, pipeline sends, the gradient sync
    # before the optimizer step). ``sync_overhead_us``: what such a call costs beyond its warm latency (gloo's
    # progress thread wakes up; ~0 for NCCL kernels queued behind the compute). ``compute_jitter``: how far ranks
    # doing the same work drift apart, seconds per sqrt(second) of compute (a random walk): every sync waits
    # sigma x sqrt(compute since the last) x E[max of n normals] for its group's last rank. None: not modelled
    # (datasheets have neither; calibration measures both: large on a shared CPU box, small on a GPU).
    sync_overhead_us: float | None = None
    compute_jitter: float | None = None
    # Share of an overlappable collective (prefetched all-gathers, gradient reductions during backward) that compute
    # hides on this machine; None: ``Assumptions.comm_overlap`` (a GPU's NCCL kernels beside compute). Calibration
    # measures it: ~0 with gloo on a CPU host, whose collective threads need the cores the compute runs on.
    comm_overlap: float | None = None
    # Host microseconds a tensor-parallel linear (DTensor) adds to a forward + backward beyond its math: dispatch,
    # sharding propagation, the collective's wrapping. None: not modelled (hidden behind GPU kernels when the host
    # runs ahead); calibration measures it, and on a CPU it is on the critical path.
    tp_linear_overhead_us: float | None = None
    # Host microseconds the tensor-parallel edges of a model (vocab-parallel embedding, final norm, LM head and the
    # loss) add to a forward + backward beyond their share of the math, charged once per model (split between the
    # first and last pipeline stage). None: the edges count as two parallel linears.
    tp_edge_overhead_us: float | None = None
    # Host microseconds a tensor-parallel block's DTensor parameters add to the step's tail (the gradients' norm,
    # clipping, the AdamW step: every op dispatched per DTensor) beyond their share of the plain block's, per block
    # on the rank and step. None: not modelled; calibration measures it in a TP run's probe.
    tp_step_overhead_us: float | None = None
    # Host cost of FSDP2 beyond the math, per unit and forward + backward (its hooks: microseconds) and per byte of
    # each copy into or out of its collective buffers (nanoseconds). None: not modelled (behind GPU kernels when the
    # host runs ahead); calibration measures both, and on a CPU they are on the critical path.
    fsdp_unit_overhead_us: float | None = None
    fsdp_copy_ns_per_byte: float | None = None
    # Host microseconds FSDP2's sharded (DTensor) parameters add to the step's tail (the gradients' norm and its
    # reduction, clipping, the AdamW step: every op dispatched per DTensor) beyond their share of the plain tail, per
    # parameter tensor on the rank and per step. None: not modelled; calibration measures both in an FSDP2 run.
    fsdp_step_tensor_us: float | None = None
    fsdp_step_fixed_us: float | None = None
    # Host cost DeepSpeed's ZeRO-1/2 engine adds beyond the math and the collectives (its per-parameter gradient
    # hooks and bucket copies each micro-batch; its step's overflow check, norm, flattening, clipping and copy back):
    # microseconds per micro-batch and nanoseconds per byte of the model's parameters, microseconds per step and
    # nanoseconds per byte of the rank's partition. None: not modelled; a diagnosed CPU ZeRO-1/2 run measures them.
    zero_backward_fixed_us: float | None = None
    zero_backward_ns_per_byte: float | None = None
    zero_step_fixed_us: float | None = None
    zero_step_ns_per_byte: float | None = None
    # Host microseconds an optimizer step spends outside its forward, backward and optimizer step: waiting for its
    # batches and the training loop's own work (its hooks, callbacks, logging). Not the machine's alone (the loader
    # and the loop are the run's), but the host's speed sets it. None: not modelled; a diagnosed CPU run measures it
    # (a GPU's host runs ahead of its kernels, and its loop hides behind them until the step's first sync).
    loop_overhead_us: float | None = None
    # Host (CPU) memory per node, shared by its devices' processes: offloaded optimizer states and parameters
    # live there. None: not checked.
    host_memory_gib: float | None = None
    source: str = ""  # datasheet the numbers come from

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    def peak_flops(self, dtype: str) -> float | None:
        """Dense peak FLOP/s per device for ``dtype`` (fp32 matmuls fall back to tf32 when listed)."""
        tflops = self.peak_tflops.get(dtype)
        if tflops is None and dtype == "fp32":
            tflops = self.peak_tflops.get("tf32")
        return None if tflops is None else tflops * 1e12


def validate_profile(hw: HardwareProfile) -> None:
    """Reject profiles that cannot describe any machine (raised as ConfigError naming the hw key)."""
    if hw.accelerator not in ACCELERATORS:
        raise ConfigError("hw.accelerator", f"'{hw.accelerator}' is not one of {list(ACCELERATORS)}", "use cpu or gpu")
    if hw.num_nodes < 1:
        raise ConfigError("hw.num_nodes", f"must be >= 1, got {hw.num_nodes}", "set hw.num_nodes=1 or more")
    if hw.devices_per_node < 1:
        raise ConfigError(
            "hw.devices_per_node", f"must be >= 1, got {hw.devices_per_node}", "set hw.devices_per_node=1 or more"
        )
    for dtype, tflops in hw.peak_tflops.items():
        if dtype not in DTYPES:
            raise ConfigError(f"hw.peak_tflops.{dtype}", f"unknown dtype '{dtype}'", f"use one of {list(DTYPES)}")
        if tflops <= 0:
            raise ConfigError(f"hw.peak_tflops.{dtype}", f"must be > 0, got {tflops}", "use the dense datasheet peak")
    for name in ("collective_busbw_gbps", "collective_latency_us"):
        for key, value in getattr(hw, name).items():
            link, _, op = key.partition(".")
            if link not in LINK_NAMES or op not in COLLECTIVES:
                raise ConfigError(
                    f"hw.{name}", f"unknown key '{key}'", f"use <link>.<op> with link in {list(LINK_NAMES)} and op "
                    f"in {list(COLLECTIVES)}, e.g. intra_node.all_reduce"
                )  # fmt: skip
            if value <= 0:
                raise ConfigError(f"hw.{name}", f"'{key}' must be > 0, got {value}", "give the measured figure")
    if hw.comm_overlap is not None and not 0.0 <= hw.comm_overlap <= 1.0:
        problem = f"must be in [0, 1], got {hw.comm_overlap}"
        raise ConfigError("hw.comm_overlap", problem, "set hw.comm_overlap=null or a measured share")
    for name in (*CALIBRATED_SCALARS, "host_memory_gib"):  # comm_overlap's upper bound: above
        value = getattr(hw, name)
        if value is not None and value < 0:
            raise ConfigError(f"hw.{name}", f"must be >= 0, got {value}", f"set hw.{name}=null or a measured figure")
    if hw.accelerator == "gpu" and hw.memory_per_device_gib is None:
        raise ConfigError("hw.memory_per_device_gib", "GPU profiles need their memory", "set it from the datasheet")
