"""A hardware profile with this machine's measured speeds in place of its datasheet ones.

The calibration (``diagnostics.calibration``) replaces, where it measured them: the matmul peak of the run's
compute dtype, the memory bandwidth (the optimizer step), the bus bandwidth and per-call latency of the intra-node
and inter-node links and of each collective on them, and what blocking syncs cost (``sync_overhead_us``,
``compute_jitter``), how much of an overlappable collective compute hides (``comm_overlap``), the host cost of a
tensor-parallel linear and of the model's parallel edges (``tp_linear_overhead_us``, ``tp_edge_overhead_us``) and
of FSDP2's units and copies (``fsdp_unit_overhead_us``, ``fsdp_copy_ns_per_byte``) and of its sharded parameters in
the step's tail (``fsdp_step_tensor_us``, ``fsdp_step_fixed_us``). ``sources`` says for each
number the planner reads whether it is ``measured`` or ``datasheet`` (or ``none``), which ``python -m plan`` prints
and run.json records.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from diagnostics.calibration import Calibration
from disttrain.config.hardware import CALIBRATED_SCALARS, HardwareProfile
from disttrain.planner.measured import MeasuredParts, measured_activations, parts_basis
from disttrain.planner.plan import DEFAULT_ASSUMPTIONS
from disttrain.planner.shapes import ModelShape
from disttrain.planner.spec import Assumptions, Workload


@dataclass(frozen=True)
class CalibratedProfile:
    hw: HardwareProfile
    sources: dict[str, str]  # field -> measured | datasheet | none
    calibration: Calibration | None = None

    @property
    def parts(self) -> MeasuredParts | None:
        """The calibration's measured block, edges and optimizer step (``planner.measured``), if it took them."""
        return MeasuredParts.from_figures(self.calibration.parts) if self.calibration is not None else None

    def basis(self, shape: ModelShape, workload: Workload) -> dict[str, str]:
        """``sources`` plus where a prediction's compute comes from for ``shape`` at ``workload``: the parts
        (``measured``: this model and micro-batch; ``scaled``: another's, by FLOPs) or ``flops`` (FLOPs over the
        matmul rate x the assumed efficiency), and likewise its optimizer step (``measured``/``scaled`` or
        ``memory_bandwidth``, Adam's state bytes over ``hbm_bandwidth_gbps``), and its activations'."""
        how = parts_basis(self.parts, shape, workload)
        activations = measured_activations(self.parts, shape, workload) is not None
        return {
            **self.sources,
            # A whole module timed as one piece has no block: its passes are the edges' figure.
            "block_forward_backward": "none" if how and self.parts and self.parts.whole_module else how or "flops",
            "edges_forward_backward": how or "flops",
            "optimizer_step": how or "memory_bandwidth",
            # A GPU probe's allocator bytes (block kept, edges' peak), or the activation formula.
            "activations": "measured" if activations else "formula",
        }

    @property
    def measured(self) -> bool:
        return "measured" in self.sources.values()

    def describe(self) -> str:
        """``peak_tflops measured, intra_node_bandwidth_gbps datasheet, ...`` for tables and run.json."""
        return ", ".join(f"{name} {source}" for name, source in self.sources.items())


def _source(value: object) -> str:
    return "datasheet" if value else "none"


def calibrated_profile(hw: HardwareProfile, calibration: Calibration | None, compute_dtype: str) -> CalibratedProfile:
    """``hw`` with the measured figures of ``calibration`` (the matmul rate of ``compute_dtype``) substituted.

    The measured matmul rate is what a large matmul reaches here, so it stands in for the peak and
    ``Assumptions.calibrated_compute_efficiency`` (not the datasheet's ``compute_efficiency``) scales it. The
    link model (``planner.links.link_time``) times a whole-world collective across nodes as its bus volume over
    the inter-node figure, so the world group's measured bus bandwidth is that figure as it is."""
    sources = {
        "peak_tflops": _source(hw.peak_flops(compute_dtype)),
        "hbm_bandwidth_gbps": _source(hw.hbm_bandwidth_gbps),
        "intra_node_bandwidth_gbps": _source(hw.intra_node_bandwidth_gbps),
        "inter_node_bandwidth_gbps": _source(hw.inter_node_bandwidth_gbps),
        "intra_node_latency_us": _source(hw.intra_node_latency_us),
        "inter_node_latency_us": _source(hw.inter_node_latency_us),
        "collective_busbw_gbps": _source(hw.collective_busbw_gbps),
        "collective_latency_us": _source(hw.collective_latency_us),
        **{name: _source(getattr(hw, name)) for name in CALIBRATED_SCALARS},
        "comm_overlap": "datasheet" if hw.comm_overlap is not None else "none",  # none: Assumptions.comm_overlap
    }
    if calibration is None:
        return CalibratedProfile(hw, sources)
    changes: dict[str, object] = {}
    rate = calibration.matmul_flops_per_s.get(compute_dtype)
    if rate:
        changes["peak_tflops"] = {**hw.peak_tflops, compute_dtype: rate / 1e12}
        sources["peak_tflops"] = "measured"
    if calibration.memory_bandwidth_gbps:
        changes["hbm_bandwidth_gbps"] = calibration.memory_bandwidth_gbps
        sources["hbm_bandwidth_gbps"] = "measured"
    intra = calibration.bus_bandwidth_gbps("intra_node")
    if intra:
        changes["intra_node_bandwidth_gbps"] = intra
        sources["intra_node_bandwidth_gbps"] = "measured"
    inter = calibration.bus_bandwidth_gbps("inter_node")
    if inter:
        changes["inter_node_bandwidth_gbps"] = inter
        sources["inter_node_bandwidth_gbps"] = "measured"
    for link in ("intra_node", "inter_node"):
        latency = calibration.latency_us.get(link)
        if latency:
            changes[f"{link}_latency_us"] = latency
            sources[f"{link}_latency_us"] = "measured"
    per_op = {f"{link}.{op}": gbps for link, ops in calibration.links.items() for op, gbps in ops.items() if gbps}
    if per_op:
        changes["collective_busbw_gbps"] = {**hw.collective_busbw_gbps, **per_op}
        sources["collective_busbw_gbps"] = "measured"
    per_op = {f"{link}.{op}": us for link, ops in calibration.op_latency_us.items() for op, us in ops.items() if us}
    if per_op:
        changes["collective_latency_us"] = {**hw.collective_latency_us, **per_op}
        sources["collective_latency_us"] = "measured"
    # Measured scalars that replace the hw profile's field of the same name where calibration took them.
    for name in CALIBRATED_SCALARS:
        value = getattr(calibration, name)
        if value is not None:
            changes[name] = value
            sources[name] = "measured"
    return CalibratedProfile(dataclasses.replace(hw, **changes), sources, calibration)  # type: ignore[arg-type]


def assumptions_for(profile: CalibratedProfile, assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> Assumptions:
    """A measured matmul rate is already what large matmuls reach here: it is scaled by the calibrated efficiency
    instead of the datasheet one."""
    if profile.sources.get("peak_tflops") != "measured":
        return assumptions
    return dataclasses.replace(assumptions, compute_efficiency=assumptions.calibrated_compute_efficiency)
