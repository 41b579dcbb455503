"""``throttling``: a device runs below its clocks (power or temperature). No config lever: the recommendation
names the device and what to check.
"""

from __future__ import annotations

from typing import Any

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding, costed, ranks_text
from diagnostics.analysis.load import RunTelemetry, Sample
from diagnostics.analysis.stats import mean, present, rounded
from diagnostics.analysis.step_measures import training_samples
from diagnostics.analysis.summary import RankPhases, Summary
from diagnostics.kinds.levers import ALL_OF_IT, Recommendation, gain, no_lever

# throttling: share of a device's NVML samples that report a thermal or power clock slowdown. Brief power-cap
# dips are normal under load; a fifth of the run is a sustained clock loss. Its cost is that share times the
# clock lost in those samples (unknown clocks: the share itself, an upper bound).
THROTTLE_SAMPLE_FRACTION = 0.20
# The thresholds above, by name, for the report (report.json's ``thresholds``).
THRESHOLDS = {"THROTTLE_SAMPLE_FRACTION": THROTTLE_SAMPLE_FRACTION}


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


def detect(run: RunTelemetry, summary: Summary, phases: list[RankPhases]) -> list[Finding]:
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


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    why = (
        f"{finding.message}; check cooling and power limits (nvidia-smi -q -d PERFORMANCE,POWER,TEMPERATURE) and "
        "move the job off that node if it persists"
    )
    return [no_lever(why, "full clocks again on that device").gaining(gain(finding, ALL_OF_IT, "the clock lost"))]
