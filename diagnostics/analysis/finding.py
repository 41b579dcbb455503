"""What a detector reports: one limiting factor of the run, with the numbers that prove it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

KINDS = (
    "crash",
    "hang",
    "input_bound",
    "straggler",
    "comm_bound",
    "memory_pressure",
    "throttling",
    "pipeline_bubble",
    "low_overlap",
    "host_overhead",
    "low_mfu",
)  # also the tie-break order: a crash or a hang explains everything else, low MFU is usually a consequence
SEVERITIES = ("critical", "warning", "info")


@dataclass(frozen=True)
class Finding:
    kind: str  # one of KINDS
    severity: str  # one of SEVERITIES
    ranks: list[int]
    evidence: dict[str, Any]
    message: str  # one line
    metric: float | None = field(default=None, compare=False)  # the number the severity was graded on
    # The share of the run this finding takes away and how that was estimated ({"fraction", "basis"}).
    cost: dict[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown finding kind {self.kind!r}; use one of {KINDS}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}; use one of {SEVERITIES}")

    def sort_key(self) -> tuple[int, int, float]:
        return SEVERITIES.index(self.severity), KINDS.index(self.kind), -(self.metric or 0.0)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("metric")
        if out["cost"] is None:  # only the kinds that estimate it carry it
            out.pop("cost")
        return out


def grade(value: float, warning: float, critical: float, *, below: bool = False) -> str | None:
    """Severity of ``value`` against two thresholds (``below``: smaller is worse); None when fine."""
    if below:
        return "critical" if value < critical else "warning" if value < warning else None
    return "critical" if value >= critical else "warning" if value >= warning else None


def ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)
