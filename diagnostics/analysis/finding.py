"""What a detector reports: one limiting factor of the run, with the numbers that prove it and what it costs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from diagnostics.analysis.thresholds import COST_CRITICAL, COST_WARNING
from diagnostics.kinds import ORDER

KINDS = ORDER  # the finding kinds, in their tie-break order (diagnostics/kinds)
SEVERITIES = ("critical", "warning", "info")
PHASES = ("data", "forward", "backward", "optimizer", "other")  # what a slow rank is slow in


def cost(fraction: float, basis: str) -> dict[str, Any]:
    """``fraction``: share of the step time that would go away without the bottleneck, clipped to [0, 1]."""
    return {"fraction": round(min(1.0, max(0.0, fraction)), 4), "basis": basis}


def severity_of(fraction: float, *, corroborated: bool = True) -> str:
    """The one scale for every kind; evidence that no second source confirms is info at most."""
    if not corroborated or fraction < COST_WARNING:
        return "info"
    return "critical" if fraction >= COST_CRITICAL else "warning"


@dataclass(frozen=True)
class Finding:
    kind: str  # one of KINDS
    severity: str  # one of SEVERITIES
    ranks: list[int]
    evidence: dict[str, Any]
    message: str  # one line
    metric: float | None = field(default=None, compare=False)  # the detector's own number (compare shows it)
    cost: dict[str, Any] = field(default_factory=lambda: cost(0.0, "not estimated"))  # {"fraction", "basis"}

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown finding kind {self.kind!r}; use one of {KINDS}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}; use one of {SEVERITIES}")

    @property
    def cost_fraction(self) -> float:
        return float(self.cost.get("fraction") or 0.0)

    def sort_key(self) -> tuple[int, float, int]:
        """Biggest lever first. Severity follows cost, except that uncorroborated findings are info whatever their
        estimate, and risks (memory) are graded on headroom: so severity first, then cost, then root causes."""
        return SEVERITIES.index(self.severity), -self.cost_fraction, KINDS.index(self.kind)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("metric")
        if out["cost"] is None:  # only the kinds that estimate it carry it
            out.pop("cost")
        return out


def costed(
    kind: str,
    ranks: list[int],
    evidence: dict[str, Any],
    message: str,
    fraction: float,
    basis: str,
    *,
    corroborated: bool = True,
    metric: float | None = None,
    graded_on: float | None = None,
) -> Finding:
    """A finding graded on its cost; ``corroborated=False`` (one source only) caps it at info.

    ``graded_on``: a lower confidence bound of the cost, where the detector has one; severity follows it
    instead of the estimate, so a cost that is only noise above a threshold does not raise the finding.
    """
    price = cost(fraction, basis)
    grade = price["fraction"] if graded_on is None else min(price["fraction"], max(0.0, graded_on))
    severity = severity_of(grade, corroborated=corroborated)
    if graded_on is not None:
        evidence = {**evidence, "cost_lower_bound": round(max(0.0, graded_on), 4)}
    if not corroborated:
        evidence = {**evidence, "corroborated": False}
    return Finding(kind, severity, ranks, evidence, message, metric, price)


def pct(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"


def ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in ranks)


def ranks_verb(ranks: list[int], singular: str, plural: str) -> str:
    """``rank 1 hides`` / ``ranks 0,1 hide``: the verb agrees with the number of ranks."""
    return f"{ranks_text(ranks)} {singular if len(ranks) == 1 else plural}"
