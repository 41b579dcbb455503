"""A run's measured speeds (matmul FLOP/s per dtype, memory bandwidth, bus bandwidth per link), read back from
its telemetry so the planner can predict with this machine's numbers instead of datasheet ones.

Pure Python over a run directory: ``python -m plan calibration=RUN_DIR`` works on a laptop over a run dir copied
from the cluster. ``RUN_DIR/calibration.json`` holds the same figures once a run has finished.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from diagnostics.analysis.stats import steady
from diagnostics.files import write_text_atomic
from diagnostics.telemetry import TELEMETRY_DIR

CALIBRATION_FILE = "calibration.json"
LINKS = ("intra_node", "inter_node")
# Collectives measured for one use only (DTensor's functional all-reduce, in TP runs): priced per op, kept out of
# the link's one figure, which stands for every collective not measured on its own.
LINK_EXCLUDED_OPS = ("functional_all_reduce",)


@dataclass(frozen=True)
class Calibration:
    matmul_flops_per_s: dict[str, float] = field(default_factory=dict)  # by compute dtype: median over ranks
    memory_bandwidth_gbps: float | None = None
    # link -> collective -> bus bandwidth GB/s (nccl-tests convention), median over ranks
    links: dict[str, dict[str, float]] = field(default_factory=dict)
    # link -> microseconds one collective call costs whatever its size: median over collectives and ranks
    latency_us: dict[str, float] = field(default_factory=dict)
    # link -> collective -> microseconds of that collective's call (median over ranks): gloo's all-gather and
    # reduce-scatter cost ~10x its all-reduce, so one figure per link misprices most of them
    op_latency_us: dict[str, dict[str, float]] = field(default_factory=dict)
    # From the start-up sync rounds (a matmul segment, then a one-element all-reduce, on every rank): microseconds a
    # blocking call costs after compute beyond its warm latency (the last rank to arrive waits only for the call:
    # median over rounds of the shortest wait), and the ranks' drift, seconds per sqrt(second) of identical work
    # (the others' extra wait); ``sync_overhead_us`` and ``compute_jitter`` of the hw profile
    sync_overhead_us: float | None = None
    compute_jitter: float | None = None
    # Share of an overlappable collective compute hides here (start-up probe: a matmul segment and an all-reduce,
    # alone and together; median over ranks): ~0 where the collective's threads need the compute's cores (gloo, a
    # rank per core), near 1 where a DMA engine moves the bytes. The hw profile's ``comm_overlap``.
    comm_overlap: float | None = None
    # Host microseconds a DTensor tensor-parallel linear adds to forward + backward beyond its math (dispatch,
    # sharding propagation, collective wrapping; median over ranks). The hw profile's ``tp_linear_overhead_us``.
    tp_linear_overhead_us: float | None = None
    # The same for the model's parallel edges (embedding, final norm, LM head, loss), once per model, where the probe
    # ran on the run's own layers. The hw profile's ``tp_edge_overhead_us``.
    tp_edge_overhead_us: float | None = None
    # Host microseconds one block's DTensor parameters add to the step's tail (gradient norm, clipping, AdamW) beyond
    # the plain block's share (median over ranks). The hw profile's ``tp_step_overhead_us``.
    tp_step_overhead_us: float | None = None
    # Host cost of FSDP2 beyond the math (median over ranks): microseconds per unit and forward + backward (its hooks),
    # and nanoseconds per byte of each copy into or out of its collective buffers. The hw profile's
    # ``fsdp_unit_overhead_us`` and ``fsdp_copy_ns_per_byte``.
    fsdp_unit_overhead_us: float | None = None
    fsdp_copy_ns_per_byte: float | None = None
    # Host microseconds FSDP2's sharded (DTensor) parameters add to the step's tail (norm, clipping, AdamW) beyond the
    # plain parameters' share, per parameter tensor and per step (median over ranks). The hw profile's
    # ``fsdp_step_tensor_us`` and ``fsdp_step_fixed_us``.
    fsdp_step_tensor_us: float | None = None
    fsdp_step_fixed_us: float | None = None
    # What DeepSpeed's ZeRO-1/2 engine adds on the host (collect/zero_step.py), per micro-batch and per step:
    # ``zero_backward_fixed_us``, ``zero_backward_ns_per_byte``, ``zero_step_fixed_us``, ``zero_step_ns_per_byte``.
    zero_backward_fixed_us: float | None = None
    zero_backward_ns_per_byte: float | None = None
    zero_step_fixed_us: float | None = None
    zero_step_ns_per_byte: float | None = None
    # Host microseconds an optimizer step spent outside its forward, backward and optimizer step: its batches' data
    # wait and the training loop's own work between the phases (hooks, callbacks, logging; the step records'
    # ``data_wait_s + other_s``), median over the steady steps of each rank, then over ranks. The hw profile's
    # ``loop_overhead_us``. CPU ranks only: the phases are timed on the host's clock, and on a GPU whose host runs
    # ahead a step's wait for its queued kernels lands wherever the host first syncs, between the phases too.
    loop_overhead_us: float | None = None
    # The run's own parts, timed at start-up (``diagnostics.collect.parts``): seconds of one block's and of the
    # edges' (embedding, final norm, head, loss) forward and backward at the run's micro-batch, sequence length and
    # precision, and of one optimizer step over a block's parameters (median over ranks), with the shape and
    # precision they were measured at (``PARTS_SHAPE_KEYS``). The planner composes each layout's step from them.
    parts: dict[str, float | int | str] | None = None
    ranks: int = 0
    # The device class it was measured on, "cpu" or "gpu" (from the ranks' meta records): its figures describe that
    # class only. None: not recorded (a calibration file written before it was).
    accelerator: str | None = None
    source: str = ""  # the run dir it was measured in

    def bus_bandwidth_gbps(self, link: str) -> float | None:
        """One figure per link for the planner's link model: the median over the collectives measured on it (the
        torch.distributed ones; a TP run's functional all-reduce is priced on its own, ``links[link][op]``)."""
        ops = [gbps for op, gbps in self.links.get(link, {}).items() if op not in LINK_EXCLUDED_OPS]
        return statistics.median(ops) if ops else None

    @property
    def empty(self) -> bool:
        return not (self.matmul_flops_per_s or self.memory_bandwidth_gbps or self.links or self.parts)


def _records(run_dir: Path) -> list[dict]:
    records = []
    for path in sorted((run_dir / TELEMETRY_DIR).glob("rank*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line of a killed rank
            if isinstance(record, dict) and record.get("kind") in (
                "calibration",
                "link_calibration",
                "memory_calibration",
                "sync_calibration",
                "overlap_calibration",
                "tp_calibration",
                "fsdp_calibration",
                "zero_calibration",
                "parts_calibration",
                "meta",
                "step",
            ):
                records.append(record)
    return records


def _positive(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else None


def _fraction(value: object, upper: float = 1.0) -> float | None:
    """``value`` when it is a number in [0, ``upper``], else None (0 is a valid measurement here)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value <= upper:
        return float(value)
    return None


# E[max of n standard normals], exact (Harter 1961) where Blom's approximation is off by more than 1%.
_EXPECTED_MAX = {2: 0.5642, 3: 0.8463, 4: 1.0294, 5: 1.1630, 6: 1.2672, 7: 1.3522, 8: 1.4236}


def expected_max_of_normals(n: int) -> float:
    """E[max of ``n`` independent standard normals]: how far the last of ``n`` drifting ranks lags their mean, in
    sigmas (tabulated up to 8, Blom's approximation above: within 0.5% from 16 on)."""
    if n < 2:
        return 0.0
    return _EXPECTED_MAX.get(n) or statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def sync_figures(segment_s: float, latency_s: float, waits: list[list[float]]) -> tuple[float, float] | None:
    """(overhead seconds, sigma) from every rank's waits per sync round (``waits[rank][round]``).

    In each round the last rank to arrive waits only for the call: the shortest wait is the call's cost after
    compute, and what it has beyond the warm ``latency_s`` is the overhead (the median over rounds). Every other
    rank also waited for the last: their mean extra wait is E[max over ranks] - E[own] = sigma x sqrt(segment) x
    E[max of n normals]. None without two ranks' rounds."""
    n = len(waits)
    rounds = min((len(w) for w in waits), default=0)
    if n < 2 or rounds == 0 or segment_s <= 0:
        return None
    shortest = [min(w[r] for w in waits) for r in range(rounds)]
    overhead = max(0.0, statistics.median(shortest) - latency_s)
    extra = statistics.mean(w[r] - shortest[r] for w in waits for r in range(rounds))
    return overhead, extra / (math.sqrt(segment_s) * expected_max_of_normals(n))


# What a parts record says about the model, micro-batch and precision it timed (equal on every rank).
PARTS_SHAPE_KEYS = ("micro_batch", "seq_len", "d_model", "vocab_size", "block_numel", "precision")
# On a GPU: the bytes one block keeps from forward for backward, and the edges' peak (planner.measured).
PARTS_MEMORY_KEYS = ("block_activation_bytes", "edges_peak_bytes")
PARTS_SECONDS_KEYS = (
    "block_forward_s",
    "block_backward_s",
    "edges_forward_s",
    "edges_backward_s",
    "optimizer_step_s",
)


def _timed_keys(record: dict) -> tuple[str, ...]:
    """The times a complete parts record has: a whole module's (a user's LightningModule, timed as one piece) has
    no block of its own, only the module's passes ("edges") and its optimizer step."""
    if record.get("whole_module"):
        return ("edges_forward_s", "edges_backward_s", "optimizer_step_s")
    return PARTS_SECONDS_KEYS


def parts_figures(records: list[dict]) -> dict[str, Any] | None:
    """The ranks' parts records as one: each time the median over ranks; the shape of the first complete record
    (records of another shape, which a rank cannot have measured in the same run, are left out). None without a
    complete record."""
    complete = [r for r in records if all(_positive(r.get(k)) for k in _timed_keys(r))]
    if not complete:
        return None
    shape = {k: complete[0].get(k) for k in PARTS_SHAPE_KEYS}
    same = [r for r in complete if all(r.get(k) == v for k, v in shape.items())]
    figures = {**shape, **{k: statistics.median(float(r.get(k) or 0.0) for r in same) for k in PARTS_SECONDS_KEYS}}
    for key in PARTS_MEMORY_KEYS:  # a GPU's allocator bytes; a CPU's records have none
        measured = [float(r[key]) for r in same if _positive(r.get(key))]
        if measured:
            figures[key] = statistics.median(measured)
    return figures


def _step_loop_s(record: dict) -> float | None:
    """A step record's time outside its phases (data wait + the loop's own work); None if it has neither."""
    parts = [_fraction(record.get(key), upper=math.inf) for key in ("data_wait_s", "other_s")]
    return None if all(p is None for p in parts) else sum(p or 0.0 for p in parts)


def loop_overhead_us(per_rank: dict[int, list[float]]) -> float | None:
    """Microseconds per step outside the phases: each rank's median over its steady steps (warm-up left out where
    enough remain, as the analysis does), then the median over ranks. None without step records."""
    medians = [statistics.median(steady(values)) for values in per_rank.values() if values]
    return statistics.median(medians) * 1e6 if medians else None


# The zero_calibration record's figures (collect/zero_step.py), each a Calibration field with a ``zero_`` prefix.
ZERO_FIGURES = ("backward_fixed_us", "backward_ns_per_byte", "step_fixed_us", "step_ns_per_byte")


def calibration_from_telemetry(run_dir: Path) -> Calibration:
    """Each rank's best matmul rate (start or end: load only ever lowers it), then the median over ranks."""
    best: dict[tuple[str, int], float] = {}
    memory: list[float] = []
    links: dict[tuple[str, str], list[float]] = {}
    latencies: dict[str, list[float]] = {}
    op_latencies: dict[tuple[str, str], list[float]] = {}
    syncs: list[tuple[float, float, list[float]]] = []  # per rank: segment, warm latency, wait per round
    overlaps: list[float] = []
    tp_overheads: list[float] = []
    tp_edges: list[float] = []
    tp_steps: list[float] = []
    fsdp_fixed: list[float] = []
    fsdp_per_byte: list[float] = []
    fsdp_step_tensor: list[float] = []
    fsdp_step_fixed: list[float] = []
    zero: dict[str, list[float]] = {name: [] for name in ZERO_FIGURES}
    parts: list[dict] = []
    loops: dict[int, list[float]] = {}  # per rank, in step order
    host_clock_ranks: set[int] = set()  # ranks computing on the CPU, whose phases are their compute's
    accelerators: set[str] = set()
    ranks: set[int] = set()
    for r in _records(run_dir):
        rank = found if isinstance(found := r.get("rank"), int) else -1
        if r["kind"] == "step":
            if (loop := _step_loop_s(r)) is not None:
                loops.setdefault(rank, []).append(loop)
            continue
        if r["kind"] == "meta":
            device = str(r.get("device", ""))
            if device.startswith("cpu"):
                host_clock_ranks.add(rank)
            if device:
                accelerators.add("cpu" if device.startswith("cpu") else "gpu")
            continue
        ranks.add(rank)
        if r["kind"] == "calibration" and (rate := _positive(r.get("flops_per_s"))) and isinstance(r.get("dtype"), str):
            key = (r["dtype"], rank)
            best[key] = max(best.get(key, 0.0), rate)
        elif r["kind"] == "memory_calibration" and (gbps := _positive(r.get("bandwidth_gbps"))):
            memory.append(gbps)
        elif (
            r["kind"] == "link_calibration"
            and (gbps := _positive(r.get("busbw_gbps")))
            and r.get("link") in LINKS
            and isinstance(r.get("op"), str)
        ):
            links.setdefault((r["link"], r["op"]), []).append(gbps)
            if latency := _positive(r.get("latency_us")):
                if r["op"] not in LINK_EXCLUDED_OPS:
                    latencies.setdefault(r["link"], []).append(latency)
                op_latencies.setdefault((r["link"], r["op"]), []).append(latency)
        elif r["kind"] == "overlap_calibration" and _fraction(r.get("hidden")) is not None:
            overlaps.append(float(r["hidden"]))
        elif r["kind"] == "tp_calibration" and _fraction(r.get("overhead_us"), upper=math.inf) is not None:
            tp_overheads.append(float(r["overhead_us"]))
            if (edges := _fraction(r.get("edge_overhead_us"), upper=math.inf)) is not None:
                tp_edges.append(edges)
            if (tail := _fraction(r.get("step_overhead_us"), upper=math.inf)) is not None:
                tp_steps.append(tail)
        elif r["kind"] == "fsdp_calibration":
            for name, values in (
                ("fixed_us", fsdp_fixed),
                ("ns_per_byte", fsdp_per_byte),
                ("step_tensor_us", fsdp_step_tensor),
                ("step_fixed_us", fsdp_step_fixed),
            ):
                if (value := _fraction(r.get(name), upper=math.inf)) is not None:
                    values.append(value)
        elif r["kind"] == "zero_calibration":
            for name, values in zero.items():
                if (value := _fraction(r.get(name), upper=math.inf)) is not None:
                    values.append(value)
        elif r["kind"] == "parts_calibration":
            parts.append(r)
        elif r["kind"] == "sync_calibration" and (segment := _positive(r.get("segment_s"))):
            waits = r.get("waits_s")
            if isinstance(waits, list) and all(_positive(w) for w in waits) and _positive(r.get("latency_s")):
                syncs.append((segment, float(r["latency_s"]), [float(w) for w in waits]))
    matmul: dict[str, list[float]] = {}
    for (dtype, _), rate in best.items():
        matmul.setdefault(dtype, []).append(rate)
    by_link: dict[str, dict[str, float]] = {}
    for (link, op), values in links.items():
        by_link.setdefault(link, {})[op] = statistics.median(values)
    op_latency: dict[str, dict[str, float]] = {}
    for (link, op), values in op_latencies.items():
        op_latency.setdefault(link, {})[op] = statistics.median(values)
    figures = None
    if syncs:  # the ranks' segments differ only by their drift: one segment length, one warm latency
        segment = statistics.mean(segment for segment, _, _ in syncs)
        latency = statistics.median(latency for _, latency, _ in syncs)
        figures = sync_figures(segment, latency, [waits for _, _, waits in syncs])
    return Calibration(
        matmul_flops_per_s={dtype: statistics.median(rates) for dtype, rates in matmul.items()},
        memory_bandwidth_gbps=statistics.median(memory) if memory else None,
        links=by_link,
        latency_us={link: statistics.median(values) for link, values in latencies.items()},
        op_latency_us=op_latency,
        sync_overhead_us=None if figures is None else figures[0] * 1e6,
        compute_jitter=None if figures is None else figures[1],
        comm_overlap=statistics.median(overlaps) if overlaps else None,
        tp_linear_overhead_us=statistics.median(tp_overheads) if tp_overheads else None,
        tp_edge_overhead_us=statistics.median(tp_edges) if tp_edges else None,
        tp_step_overhead_us=statistics.median(tp_steps) if tp_steps else None,
        fsdp_unit_overhead_us=statistics.median(fsdp_fixed) if fsdp_fixed else None,
        fsdp_copy_ns_per_byte=statistics.median(fsdp_per_byte) if fsdp_per_byte else None,
        fsdp_step_tensor_us=statistics.median(fsdp_step_tensor) if fsdp_step_tensor else None,
        fsdp_step_fixed_us=statistics.median(fsdp_step_fixed) if fsdp_step_fixed else None,
        **{f"zero_{name}": statistics.median(values) if values else None for name, values in zero.items()},
        loop_overhead_us=loop_overhead_us({r: v for r, v in loops.items() if r in host_clock_ranks}),
        parts=parts_figures(parts),
        ranks=len(ranks),
        accelerator=accelerators.pop() if len(accelerators) == 1 else None,
        source=str(run_dir),
    )


def write_calibration(run_dir: Path) -> Calibration | None:
    """RUN_DIR/calibration.json from the run's telemetry; None (nothing written) when nothing was measured."""
    calibration = calibration_from_telemetry(Path(run_dir))
    if calibration.empty:
        return None
    write_text_atomic(Path(run_dir) / CALIBRATION_FILE, json.dumps(asdict(calibration), indent=2) + "\n")
    return calibration


def read_calibration(path: Path) -> Calibration:
    """The calibration of a run dir (its calibration.json, else its telemetry) or of a calibration.json file.

    Raises ValueError naming what is missing: the caller turns it into the user's one-line error."""
    path = Path(path).expanduser()
    file = path / CALIBRATION_FILE if path.is_dir() else path
    if file.is_file():
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
            return Calibration(**data)
        except (json.JSONDecodeError, TypeError) as err:
            raise ValueError(f"{file} is not a calibration file ({err})") from None
    if not path.is_dir():
        raise ValueError(f"'{path}' is neither a run directory nor a {CALIBRATION_FILE}")
    calibration = calibration_from_telemetry(path)
    if calibration.empty:
        raise ValueError(f"'{path}' holds no calibration records (run it with diagnostics.calibrate=true)")
    return calibration
