"""Measured A/B tests of a run's recommendations: interleaved repeats, a confidence interval, a verdict.

``python -m diagnose RUN --ab --run`` drives it: ``runner`` launches the arms, ``stats`` judges them (pure
functions), ``verdict`` writes ``RUN/ab/verdict.{md,json}`` and reads them back for the run's report.
"""

from diagnostics.ab import ledger
from diagnostics.ab.runner import AbSet, Arm, RunOutcome, claim_set_dir, next_set_dir, plan_arms, run_ab
from diagnostics.ab.stats import VERDICTS, judge
from diagnostics.ab.verdict import phrase, read_verdict, verdicts_by_override, write_verdict

__all__ = [
    "VERDICTS",
    "AbSet",
    "Arm",
    "RunOutcome",
    "claim_set_dir",
    "judge",
    "ledger",
    "next_set_dir",
    "phrase",
    "plan_arms",
    "read_verdict",
    "run_ab",
    "verdicts_by_override",
    "write_verdict",
]
