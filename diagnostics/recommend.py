"""Findings -> ranked recommendations, each a concrete Hydra override of this project's config (conf/), and the
A/B multiruns that measure them.

Each kind's levers are its own module's (diagnostics/kinds/<kind>.py). Values are computed from the run's own
config (``run.json``) so an override always differs from what ran and stays legal (divisibility of the global
batch, options that exist for the current strategy and device). A finding without a config lever (a slow host, a
hot GPU, a hang) says so in ``why`` and has no override.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from diagnostics.analysis import Finding
from diagnostics.analysis.context import RunContext, hydra_value
from diagnostics.diagnosis import Analysis
from diagnostics.kinds.levers import Recommendation
from diagnostics.kinds.needs import gated
from diagnostics.kinds.registry import REGISTRY


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    """Ranked recommendations for one finding, most effective first; none the run's evidence contradicts."""
    return gated(REGISTRY[finding.kind].recommend(finding, ctx), ctx, finding)


def recommend_all(analysis: Analysis) -> list[list[Recommendation]]:
    """Recommendations of every finding of ``analysis``, in the findings' order."""
    ctx = RunContext.from_run(analysis.run)
    return [recommend(f, ctx) for f in analysis.findings]


@dataclass(frozen=True)
class AbTest:
    """One Hydra multirun: the original overrides, ``pinned``, and ``key`` swept over (original, recommended).

    ``original`` and ``recommended`` are the two arms as plain ``python -m train`` overrides, for a runner that
    launches them one run at a time (``diagnostics.ab``); ``override`` is the recommendation's own override.
    """

    key: str
    argv: tuple[str, ...]  # arguments after ``python -m train``
    note: str
    original: tuple[str, ...] = ()
    recommended: tuple[str, ...] = ()
    override: str = ""
    # The share of the step the recommendation expects to save: stored beside the measured change in the verdict.
    expected_gain: float | None = None
    finding: str | None = None  # the kind of the finding it answers (the advice ledger scores advice per kind)
    metric: str = "tokens_per_s"  # what its arms compare (Recommendation.metric)

    def shell(self) -> str:
        return f"# {self.note}\npython -m train " + " ".join(shlex.quote(a) for a in self.argv)


def _sets(override: str, key: str) -> bool:
    """Whether ``override`` sets ``key`` or, for a config group, one of its sub-keys."""
    name = override.split("=", 1)[0].lstrip("+~")
    bare = key.lstrip("+~")
    return name == bare or ("." not in bare and name.startswith(bare + "."))


def ab_test(rec: Recommendation, ctx: RunContext, original: list[str], run_dir: Path) -> AbTest | None:
    """The A/B sweep of one recommendation, or None when it has no override."""
    if rec.key is None or rec.value is None:
        return None
    changed = [rec.key, *(p.split("=", 1)[0] for p in rec.pinned)]
    base = [o for o in original if not any(_sets(o, k) for k in changed)]
    dropped = [o for o in original if o not in base]
    known, value = ctx.current(rec.key)
    slug = rec.key.lstrip("+~").replace("/", "_")
    sweep_dir = f"hydra.sweep.dir={Path(run_dir).resolve() / 'ab' / slug}"
    key = rec.key
    if not key.startswith("+") and any(o.startswith("+") and _sets(o, key) for o in dropped):
        key = "+" + key  # the original added this key (e.g. to a custom datamodule): the sweep must add it too
    if known:
        swept = f"{key}={hydra_value(value)},{rec.value}"
        arms = f"job 0 = original ({rec.key}={hydra_value(value)}), job 1 = {rec.key}={rec.value}"
    else:
        # Without run.json the original value is unknown: the analysed run itself is the A arm.
        swept = f"{key}={rec.value}"
        arms = f"original value unknown: compare with {run_dir}"
    note = f"A/B {rec.key}: {arms}" + (f"; replaces {' '.join(dropped)}" if dropped else "")
    multirun = ("-m", *base, *rec.pinned, swept, sweep_dir)
    recommended = (*base, *rec.pinned, f"{key}={rec.value}")
    gain = rec.expected_gain.get("fraction")
    expected = float(gain) if isinstance(gain, (int, float)) and rec.gain_estimated else None
    return AbTest(rec.key, multirun, note, tuple(original), recommended, rec.override, expected, metric=rec.metric)


def _original_overrides(analysis: Analysis) -> list[str]:
    # The A/B jobs get their own directories and start fresh: the run's own dir, sweep and resume do not apply.
    overrides = analysis.run.overrides or []
    return [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "resume="))]


def ab_tests(analysis: Analysis, recommendations: list[list[Recommendation]], top_k: int) -> list[AbTest]:
    """A/B sweeps for the ``top_k`` highest-ranked distinct keys among the recommendations."""
    ctx = RunContext.from_run(analysis.run)
    original = _original_overrides(analysis)
    tests: list[AbTest] = []
    for finding, recs in zip(analysis.findings, recommendations, strict=False):
        for rec in recs:
            if len(tests) >= top_k:
                return tests
            if any(t.key == rec.key for t in tests) or not rec.ab_testable:
                continue
            if (test := ab_test(rec, ctx, original, analysis.run.run_dir)) is not None:
                tests.append(replace(test, finding=finding.kind))
    return tests
