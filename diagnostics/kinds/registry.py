"""Each kind of ``ORDER`` to its module's ``recommend``: the one place that maps a finding to its levers."""

from __future__ import annotations

from importlib import import_module
from typing import Protocol, cast

from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding
from diagnostics.kinds import ORDER
from diagnostics.kinds.levers import Recommendation


class Recommender(Protocol):
    def __call__(self, finding: Finding, ctx: RunContext) -> list[Recommendation]: ...


def _recommender(kind: str) -> Recommender:
    module = import_module(f"{__package__}.{kind}")
    found = getattr(module, "recommend", None)
    if not callable(found):
        raise TypeError(f"{module.__name__} has no recommend(finding, ctx): every kind of ORDER needs one")
    return cast(Recommender, found)


# Imported at once, not on first use: a kind without its module fails when diagnostics load, not mid-report.
RECOMMENDERS: dict[str, Recommender] = {kind: _recommender(kind) for kind in ORDER}
