"""Mid-run numbers for the user's logger, from what rank 0 already holds: its own recent steps and the ranks'
window means that the collectors all-gather every ``diagnostics.gather_every`` steps.

Pure Python over plain numbers (no torch, no Lightning), so it is tested without a process group. The figures
follow the report's rules where a window allows them: the exposed communication is the smallest comm wait
over the ranks (every rank pays the transfer, only the fast ones also wait for a slow one), the rest of a
rank's comm wait is waiting; the slow rank is the one busiest outside the collective (data + local compute),
never one that only waits. The two detectors here are a cheap subset of the analysis (``input_bound``,
``straggler``) that must hold in two gathers in a row, so one slow batch does not raise an alarm; the report at
the end of the run, over every step, remains the verdict.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from diagnostics.analysis.stats import median
from diagnostics.analysis.thresholds import COST_CRITICAL, COST_WARNING, MIN_PHASE_S
from diagnostics.kinds.input_bound import INPUT_BOUND_FRACTION
from diagnostics.kinds.straggler import STRAGGLER_RATIO
from diagnostics.mfu import AccountingError, flops_utilization


@dataclass(frozen=True)
class RanksWindow:
    """One all-gather: each rank's mean seconds per step over the window since the previous gather."""

    step: int
    step_s: list[float]
    local_compute_s: list[float]
    data_wait_s: list[float]
    comm_wait_s: list[float]
    # Per rank, the node it runs on and its device's newest NVML reading (DEVICE_FIELDS; NaN where a rank has
    # none, e.g. on a CPU): the same all-gather carries them, so the logger shows every node, not rank 0's GPU.
    node: list[int] | None = None
    device: list[dict[str, float]] | None = None

    def busy_s(self, rank: int) -> float:
        """Time the rank spent on its own work before it reached the step's collective."""
        return self.data_wait_s[rank] + self.local_compute_s[rank]


@dataclass(frozen=True)
class LiveFinding:
    kind: str  # input_bound | straggler, as the report names them
    severity: str  # warning | critical, on the report's cost scale
    cost: float  # share of the step
    ranks: list[int]
    step: int
    message: str

    def line(self) -> str:
        return f"step {self.step}: {self.severity} {self.kind} [{100 * self.cost:.0f}% of step]: {self.message}"


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def severity(cost: float) -> str | None:
    if cost >= COST_CRITICAL:
        return "critical"
    return "warning" if cost >= COST_WARNING else None


def window_rate_metrics(
    tokens: float,
    seconds: float,
    world_size: int,
    flops_per_token: float,
    hardware_flops_per_token: float,
    peak_flops: float | None,
    calibrated_flops: float | None,
    suffix: str = "",
    unit: str = "token",
) -> dict[str, float]:
    """``throughput/`` keys for ``tokens`` (units of work: tokens, or samples where ``unit`` says so) trained in
    ``seconds``: the rate (job and per device), MFU and HFU against the datasheet peak and the measured one (each
    only where that peak is known)."""
    if seconds <= 0 or tokens <= 0:
        return {}
    rate = tokens / seconds
    key = f"throughput/{unit}s_per_s"
    out = {f"{key}{suffix}": rate, f"{key}_per_device{suffix}": rate / world_size}
    pairs = (
        ("mfu", flops_per_token, peak_flops),
        ("hfu", hardware_flops_per_token, peak_flops),
        ("mfu_calibrated", flops_per_token, calibrated_flops),
        ("hfu_calibrated", hardware_flops_per_token, calibrated_flops),
    )
    for name, flops, peak in pairs:
        if flops and peak:
            # The report names a broken accounting; a logger gets no impossible number.
            with contextlib.suppress(AccountingError):
                out[f"throughput/{name}{suffix}"] = flops_utilization(rate, flops, world_size, peak, name)
    return out


def step_metrics(step_s: list[float], data_wait_s: list[float], local_compute_s: list[float]) -> dict[str, float]:
    """``time/`` keys over rank 0's steps since the last log: median and slowest step, data-wait and compute share."""
    if not step_s:
        return {}
    total = sum(step_s)
    return {
        "time/step_p50_s": median(step_s) or 0.0,
        "time/step_max_s": max(step_s),
        "time/data_wait_share": _share(sum(data_wait_s), total),
        "time/compute_share": _share(sum(local_compute_s), total),
    }


DEVICE_FIELDS = ("util_pct", "power_w", "sm_clock_mhz", "temp_c")


def node_device_metrics(window: RanksWindow) -> dict[str, float]:
    """``gpu/node{n}/...``: per node, the mean over its devices of each NVML field, and the lowest utilization
    (one idle GPU on a node is what a mean hides). Ranks without a reading (NaN) are left out."""
    if window.node is None or window.device is None:
        return {}
    out: dict[str, float] = {}
    for node in sorted(set(window.node)):
        rows = [d for n, d in zip(window.node, window.device, strict=True) if n == node]
        for field in DEVICE_FIELDS:
            values = [v for d in rows if (v := d.get(field)) is not None and v == v]  # NaN != NaN
            if values:
                out[f"gpu/node{node}/{field}"] = sum(values) / len(values)
                if field == "util_pct":
                    out[f"gpu/node{node}/min_util_pct"] = min(values)
    return out


def ranks_metrics(window: RanksWindow) -> dict[str, float]:
    """``ranks/`` and ``comm/`` keys of one gather."""
    n = len(window.step_s)
    if n == 0:
        return {}
    waits = [_share(window.comm_wait_s[r], window.step_s[r]) for r in range(n)]
    exposed = min(waits)
    busy = [window.busy_s(r) for r in range(n)]
    slow = max(range(n), key=busy.__getitem__)
    mean_step = sum(window.step_s) / n
    return {
        "comm/exposed_share": exposed,
        "comm/waiting_share": sum(waits) / n - exposed,
        "ranks/step_time_gap_s": max(window.step_s) - min(window.step_s),
        "ranks/busy_gap_s": busy[slow] - min(busy),
        "ranks/busy_gap_share": _share(busy[slow] - min(busy), mean_step),
        "ranks/slowest_rank": float(slow),
    }


def _input_bound(window: RanksWindow) -> tuple[float, list[int]] | None:
    shares = [_share(window.data_wait_s[r], window.step_s[r]) for r in range(len(window.step_s))]
    waits = window.data_wait_s
    ranks = [r for r, share in enumerate(shares) if share >= INPUT_BOUND_FRACTION and waits[r] >= MIN_PHASE_S]
    if not ranks:
        return None
    return sum(shares) / len(shares), ranks  # the job waits for its data as long as the ranks do on average


def _straggler(window: RanksWindow) -> tuple[float, list[int]] | None:
    n = len(window.step_s)
    if n < 2:
        return None
    busy = [window.busy_s(r) for r in range(n)]
    slow = max(range(n), key=busy.__getitem__)
    others = median(busy[r] for r in range(n) if r != slow) or 0.0
    lead = busy[slow] - others
    # Identical ranks on shared cores differ by 5-10% from scheduling alone: the analysis's own ratio for records
    # without arrival times, and the warning cost, must both hold.
    if others <= 0 or busy[slow] < STRAGGLER_RATIO * others or lead < MIN_PHASE_S:
        return None
    return _share(lead, sum(window.step_s) / n), [slow]


DETECTORS = {"input_bound": _input_bound, "straggler": _straggler}


def _message(kind: str, window: RanksWindow, ranks: list[int]) -> str:
    if kind == "input_bound":
        waits = ", ".join(f"rank {r} {1e3 * window.data_wait_s[r]:.1f} ms" for r in ranks)
        return f"waiting for the next batch: {waits} of a {1e3 * max(window.step_s):.1f} ms step"
    slow = ranks[0]
    others = [window.busy_s(r) for r in range(len(window.step_s)) if r != slow]
    return (
        f"rank {slow} is busy {1e3 * window.busy_s(slow):.1f} ms a step (data + compute) against "
        f"{1e3 * (median(others) or 0.0):.1f} ms on the other ranks, which wait for it"
    )


def live_findings(previous: RanksWindow | None, current: RanksWindow) -> list[LiveFinding]:
    """Warning-or-critical findings that hold in both gathers (the same ranks for a straggler); the cost is the
    smaller of the two windows' costs."""
    if previous is None:
        return []
    found = []
    for kind, detect in DETECTORS.items():
        now, before = detect(current), detect(previous)
        if now is None or before is None or (kind == "straggler" and now[1] != before[1]):
            continue
        cost = min(now[0], before[0])
        level = severity(cost)
        if level is not None:
            found.append(LiveFinding(kind, level, cost, now[1], current.step, _message(kind, current, now[1])))
    return found


class FindingsSeen:
    """Which findings were already shown: each kind once, and again only if it becomes critical."""

    def __init__(self) -> None:
        self._shown: dict[str, str] = {}

    def new(self, findings: list[LiveFinding]) -> list[LiveFinding]:
        fresh = []
        for f in findings:
            shown = self._shown.get(f.kind)
            if shown is None or (shown == "warning" and f.severity == "critical"):
                self._shown[f.kind] = f.severity
                fresh.append(f)
        return fresh
