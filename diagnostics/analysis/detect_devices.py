"""Detectors over devices and the profile: low_overlap, memory_pressure, throttling, low_mfu, hang."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from diagnostics.analysis.comm_split import comm_split
from diagnostics.analysis.context import RunContext
from diagnostics.analysis.detect_steps import (
    collective_comm_s,
    exposed_comm,
    step_transfer_lower_bound,
    training_samples,
)
from diagnostics.analysis.finding import Finding, cost, costed, ranks_text, ranks_verb
from diagnostics.analysis.load import RunTelemetry, Sample, num
from diagnostics.analysis.stats import mean, median, present, ratio, rounded
from diagnostics.analysis.summary import RankPhases, Summary
from diagnostics.analysis.thresholds import (
    LOW_MFU,
    LOW_OVERLAP_RATIO,
    MEMORY_CRITICAL_FRACTION,
    MEMORY_PRESSURE_FRACTION,
    OVERLAP_MIN_COMM_FRACTION,
    THROTTLE_SAMPLE_FRACTION,
)

# NVML clocks-event (throttle) reason bits (nvml.h, nvmlClocksEventReason*). Only these slow a busy GPU down
# for thermal or power reasons; GpuIdle, application clock settings, sync boost and display clocks do not.
NVML_SLOWDOWN_BITS = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
}
SLOWDOWN_WORDS = ("power", "thermal", "slowdown")


def slowdown_reasons(value: Any) -> list[str]:
    """Thermal/power slowdown names in an NVML throttle-reasons value (bitmask int, or a list/dict of names)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [name for bit, name in NVML_SLOWDOWN_BITS.items() if value & bit]
    if isinstance(value, dict):
        value = [k for k, v in value.items() if v]
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list):
        names = [str(v).lower() for v in value]
        return [n for n in names if any(w in n for w in SLOWDOWN_WORDS)]
    return []


def detect_low_overlap(run: RunTelemetry, phases: list[RankPhases]) -> list[Finding]:
    """Collective communication the profile saw mostly unhidden, costed by what the whole run confirms.

    A collective is one event for all ranks: its hidden share is the ranks' median and its exposed cost the
    minimum over ranks (see collective_comm_s). The profile window is 3 steps; the whole run's step records
    (DDP: the wait after each rank's own backward) must show the same exposed time, else the windows of every
    rank must agree (FSDP, whose waits the step timer cannot separate). The cost is the smaller of the two.
    """
    comm_s = collective_comm_s(phases)
    hidden = {p.rank: h for p in phases if (h := ratio(p.profile_overlap_s or 0.0, p.profile_comm_s)) is not None}
    if comm_s is None or not hidden or (median(hidden.values()) or 0.0) >= LOW_OVERLAP_RATIO:
        return []
    steps, profile, _ = exposed_comm(run, phases)
    ranks = sorted(hidden)
    if not profile or len(profile) < len(ranks):
        return []
    window = min(profile.values())
    graded_on = None
    if len(steps) == len(ranks):
        fraction, corroborated = min(window, min(steps.values())), True
        basis = "exposed communication / step time: the smaller of the profile window and the whole run's comm wait"
        # Graded on what the steps show with confidence: a healthy run's few percent of exposed communication
        # read a point high on a noisy host is not a warning (benchmarks/diagnosis_accuracy.py, healthy-ddp).
        if (low := step_transfer_lower_bound(run)) is not None:
            graded_on = min(window, low)
    else:
        fraction, corroborated = window, len(profile) >= 2
        basis = "exposed communication / profiled step time, minimum over the ranks' profile windows"
    if fraction < OVERLAP_MIN_COMM_FRACTION:
        return []
    context = RunContext.from_run(run)
    busy = context.host_cores_busy()
    evidence: dict[str, Any] = {
        "overlap_over_comm": {r: rounded(hidden[r]) for r in ranks},
        "exposed_comm_fraction_profile": {r: rounded(f) for r, f in sorted(profile.items())},
        "exposed_comm_fraction_steps": {r: rounded(f) for r, f in sorted(steps.items())},
        "collective_comm_s_per_step": rounded(comm_s),
        "comm_by_op_s": {r: run.ranks[r].profiles[-1].comm_by_op for r in ranks if run.ranks[r].profiles},
        "host_cores_busy": busy,
        "threshold_ratio": LOW_OVERLAP_RATIO,
    }
    if (split := comm_split(run, context)) is not None:
        evidence["comm_split"] = split  # what fewer bytes would take away: a smaller tp, where it is tp's
    message = (
        f"{ranks_verb(ranks, 'hides', 'hide')} only {100 * (median(hidden.values()) or 0.0):.0f}% of "
        f"{'its' if len(ranks) == 1 else 'their'} communication behind compute: {100 * fraction:.0f}% of the step "
        "is exposed communication"
    )
    if busy:
        message += " (the compute threads fill every core: there is nothing to overlap with)"
    return [
        costed("low_overlap", ranks, evidence, message, fraction, basis, corroborated=corroborated, graded_on=graded_on)
    ]


def _host_memory_total(run: RunTelemetry, rank: int) -> float | None:
    tele = run.ranks[rank]
    for rec in (tele.memory or {}, tele.meta or {}):
        if (total := num(rec.get("host_memory_bytes"))) is not None:
            return total
    return max(present(s.mem_total_bytes for s in tele.samples if s.source == "cpu"), default=None)


def _memory_fractions(run: RunTelemetry, phases: list[RankPhases]) -> tuple[dict[int, float], dict[int, str]]:
    fractions: dict[int, float] = {}
    basis: dict[int, str] = {}
    for p in phases:
        gpu = ratio(p.peak_reserved_bytes, p.device_memory_bytes)
        nvml = [s for s in run.ranks[p.rank].samples if s.source == "nvml"]
        sampled = present(ratio(s.mem_used_bytes, s.mem_total_bytes) for s in nvml)
        if gpu is not None or sampled:
            fractions[p.rank] = max(present([gpu, *sampled]))
            basis[p.rank] = "gpu reserved / device memory" if gpu is not None else "nvml used / total"
    # Ranks on one host share its memory: their RSS adds up against the host total.
    hosts: dict[str, list[RankPhases]] = {}
    for p in phases:
        if p.rank not in fractions and p.peak_rss_bytes is not None:
            hosts.setdefault(p.hostname or "host", []).append(p)
    for group in hosts.values():
        total = _host_memory_total(run, group[0].rank)
        if (share := ratio(sum(p.peak_rss_bytes or 0.0 for p in group), total)) is None:
            continue
        for p in group:
            fractions[p.rank] = share
            basis[p.rank] = f"sum of RSS of {len(group)} rank(s) / host memory"
    return fractions, basis


def detect_memory_pressure(run: RunTelemetry, phases: list[RankPhases]) -> list[Finding]:
    fractions, basis = _memory_fractions(run, phases)
    flagged = sorted(r for r, f in fractions.items() if f >= MEMORY_PRESSURE_FRACTION)
    if not flagged:
        return []
    worst = max(fractions[r] for r in flagged)
    by_rank = {p.rank: p for p in phases}
    evidence = {
        "memory_fraction": {r: rounded(fractions[r]) for r in flagged},
        "basis": {r: basis[r] for r in flagged},
        "peak_reserved_bytes": {r: by_rank[r].peak_reserved_bytes for r in flagged if by_rank[r].peak_reserved_bytes},
        "device_memory_bytes": {r: by_rank[r].device_memory_bytes for r in flagged if by_rank[r].device_memory_bytes},
        "peak_rss_bytes": {r: by_rank[r].peak_rss_bytes for r in flagged if by_rank[r].peak_rss_bytes},
        "threshold_fraction": MEMORY_PRESSURE_FRACTION,
    }
    # A risk, not time: nothing is lost until the OOM, which loses the run. Graded on the headroom left.
    severity = "critical" if worst >= MEMORY_CRITICAL_FRACTION else "warning"
    message = f"{ranks_text(flagged)} peak at {100 * worst:.0f}% of memory ({basis[flagged[0]]}): close to OOM"
    price = cost(0.0, "no step time lost yet: a risk of running out of memory, graded on the headroom")
    return [Finding("memory_pressure", severity, flagged, evidence, message, worst, price)]


def detect_throttling(run: RunTelemetry, phases: list[RankPhases]) -> list[Finding]:
    shares: dict[int, float] = {}
    reasons: dict[int, list[str]] = {}
    clocks: dict[int, dict[str, float | None]] = {}
    for rank, tele in run.ranks.items():
        nvml = [s for s in training_samples(tele) if s.source == "nvml"]  # not the idle clocks of start-up
        hits = [slowdown_reasons(s.throttle_reasons) for s in nvml]
        if not nvml or not any(hits):
            continue
        shares[rank] = sum(1 for h in hits if h) / len(nvml)
        reasons[rank] = sorted({n for h in hits for n in h})
        slow = mean(s.sm_clock_mhz for s, h in zip(nvml, hits, strict=True) if h)
        full = mean(s.sm_clock_mhz for s, h in zip(nvml, hits, strict=True) if not h)
        clocks[rank] = {
            "clock_lost": rounded(1.0 - slow / full) if slow and full else None,
            "mean_sm_clock_mhz": rounded(mean(s.sm_clock_mhz for s in nvml)),
            "max_temp_c": max(present(s.temp_c for s in nvml), default=None),
            "max_power_w": max(present(s.power_w for s in nvml), default=None),
        }
    flagged = sorted(r for r, f in shares.items() if f >= THROTTLE_SAMPLE_FRACTION)
    if not flagged:
        return []
    worst = max(shares[r] for r in flagged)
    # A synchronous job runs at its slowest device: the worst device's clock loss is the job's.
    lost = {r: shares[r] * (1.0 if (c := clocks[r]["clock_lost"]) is None else c) for r in flagged}
    rated = {r: limit for r in flagged if (limit := at_rated_power(training_samples(run.ranks[r]), reasons[r]))}
    if len(rated) == len(flagged):
        # The cap the board ships with, reached under full load: how every such GPU runs, not a fault to fix.
        message = (
            f"{ranks_text(flagged)}: GPU clocks held at the rated power limit ({max(rated.values()):.0f} W) in "
            f"{100 * worst:.0f}% of samples: a fully loaded GPU's normal state"
        )
        evidence = {"throttled_sample_fraction": {r: rounded(shares[r]) for r in flagged}, "power_limit_w": rated}
        basis = "throttled share of NVML samples x SM clock lost in them; the default power limit, not lowered"
        return [costed("throttling", flagged, evidence, message, max(lost.values()), basis, corroborated=False)]
    evidence = {
        "throttled_sample_fraction": {r: rounded(shares[r]) for r in flagged},
        "reasons": {r: reasons[r] for r in flagged},
        "device": {r: clocks[r] for r in flagged},
        "threshold_fraction": THROTTLE_SAMPLE_FRACTION,
    }
    message = (
        f"{ranks_text(flagged)}: GPU clocks held down ({', '.join(reasons[flagged[0]])}) in "
        f"{100 * worst:.0f}% of samples"
    )
    basis = "throttled share of NVML samples x SM clock lost in them (unknown clocks: the share), worst device"
    return [costed("throttling", flagged, evidence, message, max(lost.values()), basis, metric=worst)]


def at_rated_power(samples: list[Sample], reasons: list[str]) -> float | None:
    """The enforced power limit when the only slowdown is the power cap and that cap is the board's default one
    (not lowered by an administrator or a job); None otherwise, or where the telemetry lacks the limits."""
    if reasons != ["sw_power_cap"]:
        return None
    limits = [(s.power_limit_w, s.default_power_limit_w) for s in samples if s.source == "nvml"]
    known = [(enforced, default) for enforced, default in limits if enforced and default]
    if not known or any(enforced < 0.99 * default for enforced, default in known):
        return None
    return max(enforced for enforced, _ in known)


def detect_low_mfu(run: RunTelemetry, summary: Summary) -> list[Finding]:
    if summary.mfu is not None:
        value, peak, source = summary.mfu, summary.peak_flops, summary.peak_flops_source or "datasheet"
        trusted = True
    elif summary.calibrated_mfu is not None:
        # A measured matmul peak is a moving target (threads, clocks): worth knowing, not worth alarming.
        value, peak, source = summary.calibrated_mfu, summary.calibrated_peak_flops, "calibrated matmul"
        trusted = False
    else:
        return []
    if value >= LOW_MFU:
        return []
    evidence = {
        "mfu": rounded(value),
        "hfu": rounded(summary.hfu if summary.mfu is not None else summary.calibrated_hfu),
        "peak_flops_per_device": peak,
        "peak_source": source,
        "tokens_per_s": rounded(summary.tokens_per_s),
        "flops_per_token": summary.flops_per_token,
        "num_devices": summary.world_size,
        "precision": run.meta("precision") or (run.manifest.config.get("precision") if run.manifest else None),
        "threshold": LOW_MFU,
    }
    per_device = f"{(peak or 0) / 1e12:.1f} TFLOP/s" if (peak or 0) >= 1e12 else f"{(peak or 0) / 1e9:.1f} GFLOP/s"
    message = f"MFU is {100 * value:.1f}% of the {source} peak ({per_device} per device)"
    basis = f"step time that would go at {100 * LOW_MFU:.0f}% MFU: 1 - MFU / {LOW_MFU}"
    ranks = list(range(summary.world_size))
    fraction = 1.0 - value / LOW_MFU
    if not trusted:  # a tiny model on a CPU is far from any matmul peak and no faster for knowing it
        fraction, basis = 0.0, "not estimated: against a calibrated matmul peak MFU is a hint, not a measured loss"
    return [costed("low_mfu", ranks, evidence, message, fraction, basis, corroborated=trusted, metric=value)]


def _in_collective(run: RunTelemetry) -> dict[int, bool]:
    """Which ranks the watchdog saw inside a collective (dict or per-rank list in one record, or a flag each)."""
    out: dict[int, bool] = {}
    for rank, tele in run.ranks.items():
        value = (tele.hang or {}).get("in_collective")
        if isinstance(value, bool):
            out[rank] = value
        elif isinstance(value, dict):
            out.update({int(k): bool(v) for k, v in value.items() if str(k).lstrip("-").isdigit()})
        elif isinstance(value, list) and all(isinstance(v, bool) for v in value):
            out.update(dict(enumerate(value)))
        elif isinstance(value, list):  # a list of the ranks that are in a collective
            inside = {v for v in value if isinstance(v, int)}
            out.update({r: r in inside for r in range(run.world_size)})
    return out


def _waiting_on_loader(records: Iterable[dict[str, Any]]) -> dict[int, list[str]]:
    """rank -> where each of its DataLoader workers is, for the ranks whose main thread waited for a batch."""
    out: dict[int, list[str]] = {}
    for record in records:
        value = record.get("waiting_on_loader")
        if isinstance(value, dict):
            for rank, frames in value.items():
                if str(rank).isdigit() and isinstance(frames, list):
                    out[int(rank)] = [str(f) for f in frames]
    return out


def detect_hang(run: RunTelemetry, phases: list[RankPhases]) -> list[Finding]:
    hung = {r: t.hang for r, t in run.ranks.items() if t.hang}
    if not hung:
        return []
    last_step = {
        r: (t.hang or {}).get("last_step", t.steps[-1].step if t.steps else None) for r, t in run.ranks.items()
    }
    inside = _in_collective(run)
    outside = sorted(r for r, v in inside.items() if not v)
    steps = [s for s in last_step.values() if isinstance(s, int)]
    behind = sorted(r for r, s in last_step.items() if isinstance(s, int) and steps and s < max(steps))
    missing = sorted(set(range(run.world_size)) - set(run.ranks))
    named = outside or behind or missing or sorted(hung)
    first = next(iter(hung.values()))
    stacks = first.get("stacks_dir")
    if isinstance(stacks, str) and stacks and not stacks.startswith("/"):
        stacks = str(run.run_dir / stacks)  # the watchdog writes it relative to the run dir
    evidence = {
        "last_step": last_step,
        "in_collective": inside,
        "timeout_s": first.get("timeout_s"),
        "stacks_dir": stacks,
        "ranks_reporting_hang": sorted(hung),
        "ranks_without_telemetry": missing,
        "ranks_finished": sorted(r for r, t in run.ranks.items() if t.end),
    }
    on_loader = _waiting_on_loader(hung.values())
    if on_loader:
        evidence["waiting_on_loader"] = on_loader
    why = "not inside a collective" if outside else "behind the others" if behind else "hung"
    loader = "".join(
        f"; rank {rank} waits for its DataLoader workers"
        + (f" ({'; '.join(frames)}): a worker stuck in its dataset or collate, or deadlocked" if frames else "")
        for rank, frames in sorted(on_loader.items())
    )
    message = (
        f"no step completed within {first.get('timeout_s', '?')} s; {ranks_text(named)} {why} — the others wait "
        f"for {'it' if len(named) == 1 else 'them'}{loader}; stacks in {stacks or 'RUN_DIR/hang/'}"
    )
    lost = cost(1.0, "no step completes: the run is lost")
    return [Finding("hang", "critical", named, evidence, message, None, lost)]
