"""Each kind of ``ORDER`` to its module's ``detect``, ``recommend`` and ``THRESHOLDS``: the one place that maps a
finding kind to the code that finds it, the levers that act on it and the values it decides on."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Protocol, cast

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding
from diagnostics.analysis.load import RunTelemetry
from diagnostics.analysis.summary import RankPhases, Summary
from diagnostics.kinds import ORDER
from diagnostics.kinds.levers import Recommendation


class Detector(Protocol):
    def __call__(self, run: RunTelemetry, summary: Summary, phases: list[RankPhases]) -> list[Finding]: ...


class Recommender(Protocol):
    def __call__(self, finding: Finding, ctx: RunContext) -> list[Recommendation]: ...


@dataclass(frozen=True)
class Kind:
    name: str
    detect: Detector  # the findings of this kind in a loaded, summarized run ([] when the run shows none)
    recommend: Recommender  # the ranked levers of one finding of this kind
    thresholds: dict[str, float]  # the module's THRESHOLDS: what its detector decides on, by name


def _kind(name: str) -> Kind:
    module = import_module(f"{__package__}.{name}")
    parts = {part: getattr(module, part, None) for part in ("detect", "recommend")}
    missing = [part for part, found in parts.items() if not callable(found)]
    if missing:
        raise TypeError(f"{module.__name__} has no {' or '.join(missing)}: every kind of ORDER needs both")
    thresholds = getattr(module, "THRESHOLDS", {})
    return Kind(name, cast(Detector, parts["detect"]), cast(Recommender, parts["recommend"]), dict(thresholds))


# Imported at once, not on first use: a kind without its module fails when diagnostics load, not mid-report.
REGISTRY: dict[str, Kind] = {name: _kind(name) for name in ORDER}
