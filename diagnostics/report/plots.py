"""The report's charts, built from an analysis: (id, caption, inline SVG or None when nothing was recorded)."""

from __future__ import annotations

from diagnostics.analysis.load import Sample
from diagnostics.diagnosis import Analysis
from diagnostics.kinds.expert_imbalance import rank_loads
from diagnostics.report.fmt import GIB
from diagnostics.report.svg import Series, lines, stacked_bars

Plot = tuple[str, str, str | None]


def step_phases(analysis: Analysis) -> Plot:
    caption = "Mean time per steady step on each rank, by phase (other = not attributed to any phase)"
    phases = [p for p in analysis.phases if p.step_s is not None]
    if not phases:
        return "step-phases", caption, None
    split = any(p.forward_s is not None for p in phases)
    keys = [("data_wait_s", "data wait")]
    keys += (
        [("forward_s", "forward"), ("backward_compute_s", "backward"), ("optimizer_s", "optimizer")] if split else []
    )
    keys += [] if split else [("local_compute_s", "local compute")]
    keys += [("comm_wait_s", "comm wait"), ("other_s", "other")]
    series = [Series(label, [getattr(p, key) or 0.0 for p in phases]) for key, label in keys]
    return (
        "step-phases",
        caption,
        stacked_bars("step-phases", "Step phases per rank", "seconds", [f"rank {p.rank}" for p in phases], series),
    )


def _sample_series(analysis: Analysis, value, scale: float = 1.0) -> list[Series]:
    t0 = min((t.first_t for t in analysis.run.ranks.values() if t.first_t is not None), default=0.0)
    out = []
    for rank in sorted(analysis.run.ranks):
        by_device: dict[int | None, list[Sample]] = {}
        for s in analysis.run.ranks[rank].samples:
            if value(s) is not None:
                by_device.setdefault(s.device_index, []).append(s)
        for device, samples in sorted(by_device.items(), key=lambda kv: kv[0] or 0):
            name = f"rank {rank}" + (f" gpu {device}" if device is not None and samples[0].source == "nvml" else "")
            samples.sort(key=lambda s: s.t)
            out.append(Series(name, [value(s) / scale for s in samples], [s.t - t0 for s in samples]))
    return out


def utilization(analysis: Analysis) -> Plot:
    gpu = analysis.summary.device == "gpu"
    what = "GPU utilization (NVML)" if gpu else "CPU utilization of each rank's process (CPU fallback)"
    caption = f"{what} over time"
    series = _sample_series(analysis, (lambda s: s.util_pct) if gpu else (lambda s: s.cpu_util_pct))
    if not series:
        return "utilization", caption, None
    top = max(100.0, max(v for s in series for v in s.values))  # CPU % can exceed 100 with several threads
    return "utilization", caption, lines("utilization", "Utilization", "seconds since start", "%", series, top)


def memory(analysis: Analysis) -> Plot:
    gpu = analysis.summary.device == "gpu"
    caption = ("GPU memory used (NVML)" if gpu else "Resident memory (RSS) of each rank") + " over time"
    series = _sample_series(analysis, (lambda s: s.mem_used_bytes) if gpu else (lambda s: s.rss_bytes), GIB)
    if not series:
        return "memory", caption, None
    return "memory", caption, lines("memory", "Memory", "seconds since start", "GiB", series)


def comm_compute(analysis: Analysis) -> Plot:
    caption = "Profiled window per step: compute alone, compute overlapped with communication, exposed comm, idle"
    phases = [p for p in analysis.phases if p.profile_total_s is not None]
    if not phases:
        return "comm-compute", caption, None

    def part(p, kind: str) -> float:
        compute, comm, overlap = p.profile_compute_s or 0.0, p.profile_comm_s or 0.0, p.profile_overlap_s or 0.0
        return {
            "compute": max(0.0, compute - overlap),
            "overlap": overlap,
            "comm": max(0.0, comm - overlap),
            "idle": p.profile_idle_s or 0.0,
        }[kind]

    labels = {"compute": "compute only", "overlap": "overlapped comm", "comm": "exposed comm", "idle": "idle"}
    series = [Series(label, [part(p, kind) for p in phases]) for kind, label in labels.items()]
    return (
        "comm-compute",
        caption,
        stacked_bars(
            "comm-compute", "Communication vs compute per rank", "seconds", [f"rank {p.rank}" for p in phases], series
        ),
    )


def step_times(analysis: Analysis) -> Plot:
    caption = "Step time of every recorded step on each rank (DDP equalizes these: see local compute for stragglers)"
    series = []
    for rank in sorted(analysis.run.ranks):
        steps = [s for s in analysis.run.ranks[rank].steps if s.step_s is not None]
        if steps:
            series.append(Series(f"rank {rank}", [s.step_s or 0.0 for s in steps], [float(s.step) for s in steps]))
    if not series:
        return "step-time", caption, None
    return "step-time", caption, lines("step-time", "Step time", "step", "seconds", series)


MAX_EXPERT_SERIES = 8  # experts drawn one by one under ep=1; the rest are summed as "other experts"


def expert_load(analysis: Analysis) -> Plot:
    """Mixture-of-experts runs: each layer's computed assignments (all steps, all ranks' tokens) by the expert-parallel
    rank that computes them (ep > 1: a taller share is the rank every all-to-all waits for), or by expert (ep = 1)."""
    caption = "Expert load per layer: share of the computed token assignments, by expert-parallel rank (or expert)"
    run = analysis.run
    layout = next((t.expert_layout for _, t in sorted(run.ranks.items()) if t.expert_layout), None)
    records = [rec for t in run.ranks.values() for rec in t.experts]
    if layout is None or not records:
        return "expert-load", caption, None
    layers = len(records[0]["routed"])
    per_expert = [[0] * layout["num_experts"] for _ in range(layers)]
    for rec in records:
        for layer, (routed, dropped) in enumerate(zip(rec["routed"], rec["dropped"], strict=True)):
            per_expert[layer] = [n + r - d for n, r, d in zip(per_expert[layer], routed, dropped, strict=True)]
    ep = int(layout.get("ep") or 1)
    if ep > 1:
        names = [f"ep rank {j}" for j in range(ep)]
        groups = rank_loads(per_expert, layout, ep)  # each rank's experts, as placed (strategy.expert_placement)
    else:
        busiest = sorted(range(layout["num_experts"]), key=lambda e: -sum(c[e] for c in per_expert))
        shown = sorted(busiest[:MAX_EXPERT_SERIES])
        names = [f"expert {e}" for e in shown] + (["other experts"] if len(busiest) > len(shown) else [])
        groups = [
            [c[e] for e in shown] + ([sum(c) - sum(c[e] for e in shown)] if len(names) > len(shown) else [])
            for c in per_expert
        ]
    shares = [[n / sum(g) if sum(g) else 0.0 for n in g] for g in groups]
    series = [Series(name, [row[k] for row in shares]) for k, name in enumerate(names)]
    categories = [f"layer {layer}" for layer in range(layers)]
    return "expert-load", caption, stacked_bars("expert-load", "Expert load", "share", categories, series)


def all_plots(analysis: Analysis) -> list[Plot]:
    plots = [plot(analysis) for plot in (step_phases, comm_compute, utilization, memory, step_times)]
    experts = expert_load(analysis)
    return plots + ([experts] if experts[2] is not None else [])  # dense runs: no empty expert chart
