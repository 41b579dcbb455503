"""``hang``: ranks stopped making progress. No config lever: the recommendation names where each rank's stack was."""

from __future__ import annotations

from diagnostics.analysis import Finding
from diagnostics.analysis.context import RunContext
from diagnostics.kinds.levers import Recommendation, no_lever


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    why = (
        f"read the Python stacks of ranks {finding.ranks} in {finding.evidence.get('stacks_dir') or 'RUN_DIR/hang/'}:"
        " a rank outside the collective the others wait in is usually a rank-dependent branch, an exception "
        "swallowed on one rank, or a deadlocked data loader"
    )
    return [no_lever(why, "the job completes").gaining({"fraction": 1.0, "basis": "the run completes"})]
