"""The finding kinds: what limits a run, one module per kind, named in ``ORDER``.

A kind's module (``diagnostics/kinds/<kind>.py``) holds its ``detect(run, summary, phases)``, the findings of that
kind in a loaded run with the measurements that prove them and their cost, and its ``recommend(finding, ctx)``, the
ranked Hydra overrides that act on one finding, each sized from that cost, or the reason no config lever exists. What
several kinds measure lives in ``diagnostics/analysis`` (``step_measures``, ``summary``), the levers several kinds
propose beside them (``levers``, ``comm_levers``), and ``needs`` refuses a lever the run's own evidence contradicts,
for every kind at once. ``registry`` finds each kind's module from ``ORDER``; diagnostics/diagnosis.py runs every
detector and reconciles what they found. Adding a kind is its module and its name here (docs/extension.md).

``ORDER`` is the tie-break between findings of equal severity and cost: a run's end (crash, hang, non-finite stop)
explains everything else, and low MFU is usually a consequence of the others. It imports nothing, so that
``analysis.finding`` can validate and order findings without importing the kinds' modules (which import it).
"""

from __future__ import annotations

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
