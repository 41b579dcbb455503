"""The finding kinds: what limits a run, one module per kind, named in ``ORDER``.

A kind's module (``diagnostics/kinds/<kind>.py``) holds its ``recommend(finding, ctx)``: the ranked Hydra overrides
that act on it, each sized from the finding's measured cost, or the reason no config lever exists. Levers that several
kinds propose live beside them (``levers``, ``comm_levers``), and ``needs`` refuses a lever the run's own evidence
contradicts, for every kind at once. ``registry`` finds each kind's module from ``ORDER``, so adding a kind is its
module and its name here (docs/extension.md).

``ORDER`` is the tie-break between findings of equal severity and cost: a run's end (crash, hang, non-finite stop)
explains everything else, and low MFU is usually a consequence of the others. It imports nothing, so that
``analysis.finding`` can validate and order findings without importing the kinds' modules (which import it).
"""

ORDER = (
    "crash",
    "hang",
    "nonfinite",
    "input_bound",
    "straggler",
    "comm_bound",
    "memory_pressure",
    "throttling",
    "pipeline_bubble",
    "expert_imbalance",
    "pauses",
    "low_overlap",
    "host_overhead",
    "low_mfu",
)
