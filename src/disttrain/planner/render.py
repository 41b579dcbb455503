"""Human output of a plan: the rich table of candidates and the lines around it."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from disttrain.planner.plan import GIB, CandidatePlan, Plan, suggest_micro_batch
from disttrain.planner.shapes import hardware_flops_per_token
from disttrain.planner.spec import RECOMPUTE
from disttrain.planner.step_time import Utilization, mfu_from_throughput, model_flops, peak_flops


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f}"


def _breakdown(c: CandidatePlan) -> str:
    m = c.memory
    parts = [
        f"P {_gib(m.params)}",
        f"G {_gib(m.grads)}",
        f"O {_gib(m.optimizer_states)}",
        f"A {_gib(m.activations)}",
        f"B {_gib(m.buffers)}",
    ]
    if m.step_temporaries > m.activations + m.buffers:
        parts.append(f"step {_gib(m.step_temporaries)}")
    if m.host:
        parts.append(f"host {_gib(m.host)}")
    if m.nvme:
        parts.append(f"nvme {_gib(m.nvme)}")
    return " ".join(parts)


def _rate(tokens_per_s: float) -> str:
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.2f}M"
    if tokens_per_s >= 1e3:
        return f"{tokens_per_s / 1e3:.1f}k"
    return f"{tokens_per_s:.0f}"


def plan_table(result: Plan, limit: int | None = None) -> Table:
    """One row per candidate (the first ``limit``), ranked; the recommended one is row 1 when it fits."""
    table = Table(title=f"{result.shape.name} on {result.hw.name}: {len(result.candidates)} candidate layouts")
    for name, justify in (
        ("#", "right"),
        ("layout", "left"),
        ("mem/GPU GiB", "right"),
        ("params/grads/optim/act/buffers GiB", "left"),
        ("fits", "center"),
        ("comm/step GB intra+inter", "right"),
        ("bubble", "right"),
        ("step s", "right"),
        (f"{result.shape.unit}s/s", "right"),
        ("MFU", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    shown = result.candidates if limit is None else result.candidates[:limit]
    for rank, c in enumerate(shown, start=1):
        style = "bold green" if c is result.recommended else (None if c.fits else "dim")
        table.add_row(
            str(rank),
            c.label,
            _gib(c.memory.total),
            _breakdown(c),
            "yes" if c.fits else "no",
            f"{c.comm.intra / 1e9:.1f}+{c.comm.inter / 1e9:.1f}",
            f"{c.bubble_fraction:.1%}",
            f"{c.step_time_s:.3g}",
            _rate(c.tokens_per_s),
            f"{c.mfu:.1%}",
            style=style,
        )
    return table


def summary_lines(result: Plan, train_prefix: str, limit: int | None) -> list[str]:
    """The lines printed under the table: what was planned, the recommendation and how to run it."""
    w, shape = result.workload, result.shape
    batch = (
        f"micro-batch {w.micro_batch_size} samples, global batch {w.global_batch_size} samples"
        if shape.measured_module
        else f"micro-batch {w.micro_batch_size} x {w.seq_len} tokens, global batch {w.global_batch_size} sequences"
    )
    lines = [
        f"{shape.num_parameters:,} parameters, {result.hw.world_size} x {result.hw.device_type}, {w.precision}, {batch}"
    ]
    if limit is not None and len(result.candidates) > limit:
        lines.append(f"({len(result.candidates) - limit} more candidates not shown; output=json lists all)")
    if not shape.known and not shape.measured_module:
        lines.append("raw parameter count: memory is model states only (activations and working buffers unknown)")
    best = result.recommended
    if best is None:
        lines.append(f"no recommendation: {result.reason()}")
        micro = suggest_micro_batch(result)
        if micro is not None:
            lines.append(f"a layout fits at trainer.micro_batch_size={micro} (same global batch, more accumulation)")
        else:
            lines.append("no smaller micro-batch fits either: add GPUs (hw.num_nodes) or a larger-memory hw profile")
        return lines
    lines.append(f"recommended: {best.label} ({result.reason()})")
    lines.append(f"  {train_prefix} {' '.join(best.overrides)}".rstrip())
    return lines


def throughput_utilization(result: Plan, tokens_per_s: float, recompute: str = "none") -> Utilization:
    """MFU and HFU a measured global ``tokens_per_s`` means for this model on this hw and precision."""
    w = result.workload
    return mfu_from_throughput(
        tokens_per_s,
        model_flops(result.shape, w.seq_len),
        result.hw.world_size,
        peak_flops(result.hw, w.precision),
        hardware_flops_per_token(result.shape, w.seq_len, recompute),
    )


def throughput_line(result: Plan, tokens_per_s: float) -> str:
    none = throughput_utilization(result, tokens_per_s, "none")
    full = throughput_utilization(result, tokens_per_s, "full")
    return (
        f"measured {tokens_per_s:,.0f} tokens/s on {result.hw.world_size} x {result.hw.device_type} means "
        f"MFU {none.mfu:.1%} (HFU {none.hfu:.1%} without recomputation, {full.hfu:.1%} with full recomputation)"
    )


def json_payload(result: Plan, tokens_per_s: float | None) -> dict[str, Any]:
    """``Plan.to_json`` plus, when nothing fits, the micro-batch that would, and a measured rate's MFU/HFU."""
    payload = result.to_json()
    payload["compute_basis"] = compute_line(result).removeprefix("compute: ")
    if result.recommended is None:
        payload["suggested_micro_batch_size"] = suggest_micro_batch(result)
    if tokens_per_s is not None:
        payload["throughput"] = {
            "tokens_per_s": tokens_per_s,
            "mfu": throughput_utilization(result, tokens_per_s).mfu,
            "hfu_by_recompute": {mode: throughput_utilization(result, tokens_per_s, mode).hfu for mode in RECOMPUTE},
        }
    return payload


def sources_line(sources: dict[str, str]) -> str:
    """Which hw numbers the predictions rest on: measured (``calibration=``) or the profile's datasheet."""
    named = ", ".join(f"{name} {source}" for name, source in sources.items() if source != "none")
    # What neither gives is left out of the predictions (no latency: calls are free; no jitter: ranks never drift);
    # without per-collective figures each collective simply uses its link's, and without a measured overlap the
    # assumption (``comm_overlap``) stands in, so those are not listed.
    missing = ", ".join(
        name
        for name, source in sources.items()
        if source == "none" and not name.startswith("collective_") and name != "comm_overlap"
    )
    return f"hw numbers: {named or 'none given'}" + (f"; not modelled: {missing}" if missing else "")


def compute_line(result: Plan) -> str:
    """Where the step times' compute comes from: a run's measured parts, those scaled to this model by FLOPs, or
    FLOPs over the peak x the assumed efficiency (each an assumption of its own, said so)."""
    basis = result.candidates[0].estimate.compute_basis if result.candidates else "flops"
    parts = result.parts
    if parts is not None and parts.whole_module and basis in ("measured", "scaled"):
        how = "as measured" if basis == "measured" else f"scaled by samples from micro-batch {parts.micro_batch}"
        return f"compute: this module's training step, backward and optimizer step timed by a run, {how}"
    if basis == "measured" and parts is not None:
        return "compute: the measured parts of this model (one block, the edges, a block's optimizer step)"
    if basis == "scaled" and parts is not None:
        return (
            f"compute: measured parts of another model or workload (d_model {parts.d_model}, micro-batch "
            f"{parts.micro_batch} x {parts.seq_len}) scaled by FLOPs (assumes this device's time per FLOP carries over)"
        )
    return (
        f"compute: FLOPs over the peak x compute_efficiency {result.assumptions.compute_efficiency:g} (an assumption; "
        "pass calibration=RUN_DIR of a run of this model on this device class to measure it)"
    )


def print_plan(
    console: Console,
    result: Plan,
    train_prefix: str,
    limit: int | None,
    tokens_per_s: float | None,
    sources: dict[str, str] | None = None,
    notes: tuple[str, ...] = (),
) -> None:
    """The table, then the summary lines (soft-wrapped: the train command must stay one copyable line); ``notes``:
    what a measured module's plan stands on."""
    console.print(plan_table(result, limit))
    lines = summary_lines(result, train_prefix, limit)
    if sources:
        lines.insert(1, sources_line(sources))
    lines.insert(2 if sources else 1, compute_line(result))
    if tokens_per_s is not None:
        lines.append(throughput_line(result, tokens_per_s))
    lines[1:1] = [f"note: {note}" for note in notes]
    for line in lines:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
