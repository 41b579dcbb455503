"""The link model under every communication plan: ring collectives' volume per rank, split by link class, and its
time at link bandwidth (a profile's measured bus bandwidth and latency per op where it has them).

Ring collectives over ``n`` ranks move, per rank, ``2 (n-1)/n`` of the buffer for an all-reduce and
``(n-1)/n`` for a reduce-scatter or all-gather (Rajbhandari et al. 2020, sec. 7; Thakur et al. 2005). A ring
over ranks placed node by node crosses the node boundary on one of every ``g`` edges, ``g`` being the group's
ranks per node: that share of the volume goes over the inter-node network, the rest over NVLink/PCIe.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from disttrain.config.hardware import HardwareProfile

# functional_all_reduce: TP's activation all-reduces as DTensor issues them (out of place, then a wait); priced as
# an all-reduce where a profile does not give it its own figures.
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "p2p", "functional_all_reduce")


# An op a profile has no figure for falls back to this op's, then to the link's.
FALLBACK_OP = {"functional_all_reduce": "all_reduce"}


@dataclass(frozen=True)
class Group:
    """A process group: its size and how many of its ranks share a node."""

    size: int
    per_node: int


@dataclass(frozen=True)
class OpTraffic:
    """One collective's share of a ``LinkBytes``: its bytes and calls per link class."""

    op: str
    intra: float = 0.0
    inter: float = 0.0
    intra_calls: float = 0.0
    inter_calls: float = 0.0

    def scale(self, k: float) -> OpTraffic:
        return OpTraffic(self.op, self.intra * k, self.inter * k, self.intra_calls * k, self.inter_calls * k)


@dataclass(frozen=True)
class LinkBytes:
    """Bytes one GPU sends over each link class."""

    intra: float = 0.0  # NVLink / PCIe between GPUs of a node
    inter: float = 0.0  # the inter-node network
    host: float = 0.0  # PCIe to host memory (offload)
    # Collective calls, each paying its link's latency once (many small calls cost more than one large one).
    intra_calls: float = 0.0  # calls whose group stays inside a node
    inter_calls: float = 0.0  # calls whose group spans nodes
    # The same traffic per collective (sorted by op): a profile may give each collective its own bus bandwidth
    # and latency (gloo's all-gather and reduce-scatter run at a fraction of its all-reduce's bandwidth).
    ops: tuple[OpTraffic, ...] = ()

    def __add__(self, other: LinkBytes) -> LinkBytes:
        merged = {t.op: t for t in self.ops}
        for t in other.ops:
            mine = merged.get(t.op, OpTraffic(t.op))
            merged[t.op] = OpTraffic(
                t.op,
                mine.intra + t.intra,
                mine.inter + t.inter,
                mine.intra_calls + t.intra_calls,
                mine.inter_calls + t.inter_calls,
            )
        return LinkBytes(
            self.intra + other.intra,
            self.inter + other.inter,
            self.host + other.host,
            self.intra_calls + other.intra_calls,
            self.inter_calls + other.inter_calls,
            tuple(merged[op] for op in sorted(merged)),
        )

    def scale(self, k: float) -> LinkBytes:
        return LinkBytes(
            self.intra * k,
            self.inter * k,
            self.host * k,
            self.intra_calls * k,
            self.inter_calls * k,
            tuple(t.scale(k) for t in self.ops),
        )

    @property
    def network(self) -> float:
        """Bytes between GPUs (what ``comm_bytes_per_step`` reports); host traffic is separate."""
        return self.intra + self.inter

    def to_json(self) -> dict[str, int]:
        return {"intra_node": round(self.intra), "inter_node": round(self.inter), "total": round(self.network)}


ZERO = LinkBytes()


def collective_factor(op: str, n: int) -> float:
    """Bytes each rank sends per byte of the full buffer."""
    if op in ("all_reduce", "functional_all_reduce"):
        return 2.0 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if op == "p2p":
        return 1.0
    raise ValueError(f"unknown collective {op!r}; expected one of {OPS}")


def collective_bytes(op: str, nbytes: float, group: Group, calls: float = 1) -> LinkBytes:
    """Per-rank traffic of ``op`` over ``nbytes`` (the full, unsharded buffer; a p2p message's size), issued as
    ``calls`` collectives (e.g. one per FSDP unit) that together move those bytes."""
    if group.size <= 1 or nbytes <= 0:
        return ZERO
    volume = collective_factor(op, group.size) * nbytes
    if group.per_node >= group.size:
        return LinkBytes(intra=volume, intra_calls=calls, ops=(OpTraffic(op, intra=volume, intra_calls=calls),))
    inter = volume / group.per_node
    ops = (OpTraffic(op, intra=volume - inter, inter=inter, inter_calls=calls),)
    return LinkBytes(intra=volume - inter, inter=inter, inter_calls=calls, ops=ops)


def link_time(traffic: LinkBytes, hw: HardwareProfile, host_gbps: float) -> float:
    """Seconds for ``traffic``: intra- and inter-node links run concurrently (a pipelined ring), every GPU of a
    node shares the node's inter-node bandwidth, each call pays its link's latency (when the profile gives one:
    a calibration measures it), and host copies come on top. A collective the profile gives its own bus bandwidth
    or latency (``hw.collective_busbw_gbps``/``collective_latency_us``, keyed ``<link>.<op>``) uses them."""
    untagged = OpTraffic(
        "",
        traffic.intra - sum(t.intra for t in traffic.ops),
        traffic.inter - sum(t.inter for t in traffic.ops),
        traffic.intra_calls - sum(t.intra_calls for t in traffic.ops),
        traffic.inter_calls - sum(t.inter_calls for t in traffic.ops),
    )
    intra = inter = 0.0
    for t in (*traffic.ops, untagged):
        intra += _op_seconds(t.op, "intra_node", t.intra, t.intra_calls, hw, 1)
        inter += _op_seconds(t.op, "inter_node", t.inter, t.inter_calls, hw, hw.devices_per_node)
    return max(intra, inter) + _seconds(traffic.host, host_gbps, "assumptions.host_link_gbps")


def _op_seconds(op: str, link: str, nbytes: float, calls: float, hw: HardwareProfile, sharing: int) -> float:
    """``nbytes`` (each of ``sharing`` GPUs sending as many at once) and ``calls`` latencies of ``op`` on ``link``."""
    keys = [f"{link}.{op}"] + ([f"{link}.{FALLBACK_OP[op]}"] if op in FALLBACK_OP else [])
    gbps = next((hw.collective_busbw_gbps[k] for k in keys if hw.collective_busbw_gbps.get(k)), None)
    gbps = gbps or getattr(hw, f"{link}_bandwidth_gbps")
    latency = next((hw.collective_latency_us[k] for k in keys if hw.collective_latency_us.get(k)), None)
    latency = latency or getattr(hw, f"{link}_latency_us") or 0.0
    # Rounding in the untagged remainder can leave -1e-9 bytes: no time, and no "bandwidth not set" error.
    seconds = _seconds(nbytes * sharing, gbps, f"hw.{link}_bandwidth_gbps") if nbytes > 1e-6 else 0.0
    return seconds + max(0.0, calls) * latency * 1e-6


def _seconds(nbytes: float, gbps: float | None, key: str) -> float:
    if nbytes <= 0:
        return 0.0
    if not gbps:
        raise ValueError(f"{key} is not set but this layout sends {nbytes:.3g} bytes over that link")
    return nbytes / (gbps * 1e9)


@dataclass(frozen=True)
class Sync:
    """Blocking collectives after which every rank of a ``group``-rank group has waited for the last to arrive."""

    group: int
    calls: float
    # Overlappable collectives (FSDP's prefetched all-gathers and its reduce-scatters during backward): they wait for
    # the group's last rank only as far as compute does not hide them (``estimate_step`` scales their calls by the
    # share not hidden: all of them with gloo on a CPU, whose collective threads need the compute's cores).
    hideable: bool = False


@dataclass(frozen=True)
class CommPlan:
    """Traffic of one optimizer step on one GPU, by when it happens and what compute can hide it."""

    mb_fwd: LinkBytes = ZERO  # every micro-batch, hidden behind its forward (prefetched all-gathers)
    mb_bwd: LinkBytes = ZERO  # every micro-batch, hidden behind its backward (gradient reduction)
    mb_exposed: LinkBytes = ZERO  # every micro-batch, on the critical path (TP collectives, pipeline p2p)
    step_fwd: LinkBytes = ZERO  # once, hidden behind the first micro-batch's forward (param all-gather)
    step_bwd: LinkBytes = ZERO  # once, hidden behind the last micro-batch's backward (gradient reduction)
    step_exposed: LinkBytes = ZERO  # once, exposed (post-step all-gathers, host optimizer traffic)
    host_optimizer_parameters: int = 0  # parameters the host's optimizer updates per step (offload)
    # ZeRO-Infinity's NVMe traffic, reads and writes: per step (the optimizer's states in and out) and per
    # micro-batch (the parameter partition read for forward and backward); exposed, at ``assumptions.nvme_gbps``.
    nvme_step_bytes: float = 0.0
    nvme_mb_bytes: float = 0.0
    # Blocking syncs (the planner charges each the wait for the group's last rank): per micro-batch (TP activation
    # collectives, pipeline sends, FSDP/ZeRO gradient reductions) and per step (the world-wide gradient and
    # non-finite checks before the optimizer step). Prefetched all-gathers are not syncs: their slack absorbs drift.
    mb_syncs: tuple[Sync, ...] = ()
    step_syncs: tuple[Sync, ...] = ()
    # Tensor-parallel (DTensor) modules the busiest rank runs forward and backward every micro-batch: each costs the
    # host ``hw.tp_linear_overhead_us`` beyond its math (dispatch, sharding propagation, collective wrapping).
    mb_tp_modules: float = 0.0
    # Of those, the model's parallel edges (embedding; final norm, head and loss) as a share of the whole model's:
    # 1 without pipelining, 1/2 on a first or last stage. Charged ``hw.tp_edge_overhead_us`` where it was measured.
    mb_tp_edges: float = 0.0
    # FSDP2 units the busiest rank's forward and backward pass through every micro-batch (each costs the host
    # ``hw.fsdp_unit_overhead_us``: its hooks), and the bytes FSDP2 copies on the host per micro-batch (parameters out
    # of each all-gather buffer, gradients into each reduce-scatter buffer; a step's once-only copies spread over its
    # micro-batches), each at ``hw.fsdp_copy_ns_per_byte``. Over a one-rank mesh too: the copies remain.
    mb_fsdp_units: float = 0.0
    mb_fsdp_copy_bytes: float = 0.0
    # Parameter tensors the busiest rank holds as FSDP2 DTensors: the step's tail (norm, clipping, AdamW) dispatches
    # every op per tensor, at ``hw.fsdp_step_tensor_us`` each beyond the plain share (tensor-parallel DTensors are
    # ``hw.tp_step_overhead_us``'s instead).
    step_fsdp_tensors: float = 0.0
    # Of ``mb_exposed``, tensor parallelism's activation collectives (attribution only: already counted there).
    mb_tp: LinkBytes = ZERO

    def per_step(self, microbatches: int) -> LinkBytes:
        per_mb = self.mb_fwd + self.mb_bwd + self.mb_exposed
        return per_mb.scale(microbatches) + self.once_per_step()

    def once_per_step(self) -> LinkBytes:
        """The traffic a step moves once whatever its micro-batches: what more accumulation spreads over more
        tokens (a gradient reduction that waits for the last micro-batch, a post-step all-gather)."""
        return self.step_fwd + self.step_bwd + self.step_exposed


def comm_shares(plan: CommPlan, microbatches: int, hw: HardwareProfile, host_gbps: float) -> dict[str, float]:
    """Shares of a step's link time: moved once per optimizer step (``once_per_step``: what doubling the
    accumulation halves per token), by tensor parallelism (``tensor_parallel``: every micro-batch's activations,
    which only a smaller tp shrinks) and by the gradient reductions (``gradient_reduction``: what a half-precision
    reduction halves). Empty when the step moves nothing."""
    total = link_time(plan.per_step(microbatches), hw, host_gbps)
    if total <= 0:
        return {}
    once = link_time(plan.once_per_step(), hw, host_gbps)
    tp = link_time(plan.mb_tp.scale(microbatches), hw, host_gbps)
    reductions = link_time(_only(plan.per_step(microbatches), GRADIENT_OPS), hw, host_gbps)
    return {
        "once_per_step": round(min(1.0, once / total), 4),
        "tensor_parallel": round(min(1.0, tp / total), 4),
        "gradient_reduction": round(min(1.0, reductions / total), 4),
    }


# The collectives that move gradients (tensor parallelism's are "functional_all_reduce", experts' "all_to_all").
GRADIENT_OPS = ("all_reduce", "reduce_scatter")


def _only(traffic: LinkBytes, ops: tuple[str, ...]) -> LinkBytes:
    """The part of ``traffic`` that collectives ``ops`` move."""
    kept = tuple(t for t in traffic.ops if t.op in ops)
    return LinkBytes(
        sum(t.intra for t in kept),
        sum(t.inter for t in kept),
        0.0,
        sum(t.intra_calls for t in kept),
        sum(t.inter_calls for t in kept),
        kept,
    )


def combine(a: CommPlan, b: CommPlan) -> CommPlan:
    """Two parts of one step's traffic (the dense model's and the experts'), added field by field."""
    merged = {}
    for f in dataclasses.fields(CommPlan):
        x, y = getattr(a, f.name), getattr(b, f.name)
        merged[f.name] = x + y  # LinkBytes, sync tuples and counts all add
    return CommPlan(**merged)
