"""Human formatting of report numbers (shared by the text, Markdown and HTML renderings)."""

from __future__ import annotations

from typing import Any

GIB = 1024**3


def pct(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{100 * value:.{digits}f}%"


def seconds(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value < 1e-3:
        return f"{value * 1e6:.0f} µs"
    if value < 1:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


def gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / GIB:.2f} GiB"


def rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def flops(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value / 1e12:.1f} TFLOP/s" if value >= 1e12 else f"{value / 1e9:.1f} GFLOP/s"


def peak_memory(peaks: dict[str, Any]) -> tuple[str, float | None]:
    """(label, bytes) of the most telling memory peak: GPU reserved, then allocated, then host RSS."""
    for key, label in (
        ("peak_reserved_bytes", "GPU reserved"),
        ("peak_allocated_bytes", "GPU allocated"),
        ("peak_sampled_device_bytes", "GPU used (NVML)"),
        ("peak_rss_bytes", "host RSS"),
    ):
        if peaks.get(key):
            return label, peaks[key]
    return "memory", None


def rank_label(ranks: list[int]) -> str:
    return "no rank" if not ranks else ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """Nested config dict -> ``{"a.b.c": value}``."""
    if not isinstance(config, dict):
        return {prefix: config} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted))
        else:
            out[dotted] = value
    return out


def scale_of(kind: str) -> str:
    """What a finding's cost is a share of: the step, or for pauses (outside the steps) the loop's wall time."""
    return "the run's time" if kind == "pauses" else "the step"


def scale_of_rec(rec: Any) -> str:
    return "the run's time" if getattr(rec, "metric", "tokens_per_s") == "loop_tokens_per_s" else "the step"


def cost_text(finding: Any) -> str:
    """``23% of the step``: a finding's cost as the report shows it."""
    return f"{pct(finding.cost_fraction, 0)} of {scale_of(finding.kind)}"


def gain_text(rec: Any) -> str:
    """``saves ~20% of the step: basis`` of a recommendation (its expected gain)."""
    expected = rec.expected_gain
    if not getattr(rec, "ab_testable", True):  # a stability lever: its gain is not in step time
        return str(expected.get("basis"))
    if not getattr(rec, "gain_estimated", True):
        return f"saving {expected.get('basis')}"
    return f"saves ~{pct(expected.get('fraction'), 0)} of {scale_of_rec(rec)}: {expected.get('basis')}"
