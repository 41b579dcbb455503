"""The thresholds every finding kind shares, each with the reason for its value; a kind's own live in its module
(diagnostics/kinds/<kind>.py, ``THRESHOLDS``).

Fractions are of the mean step time of a rank after the warm-up steps are dropped. A finding needs both a
relative and (where noise matters) an absolute margin, so that microsecond phases of a tiny CPU run cannot
trigger it. A kind's thresholds decide whether a phenomenon is there at all (beyond noise); how bad it is comes
from its cost on the one scale below.
"""

from __future__ import annotations

# Severity of every kind, from its cost: the share of the step time that would go away without the bottleneck.
# 5%: below it a fix is not worth a user's afternoon, and this class of machine cannot even measure it (two
# identical CPU runs differ by 2-3% in tokens/s, so an A/B needs several repeats to resolve 3%). 25%: a quarter
# of every step lost is the run's dominant problem, worth fixing before any other tuning. The exceptions are
# risks, not time: a hang and a crash lose the whole run (cost 1.0); memory pressure loses nothing yet and is
# graded on its headroom (MEMORY_*).
COST_WARNING = 0.05
COST_CRITICAL = 0.25
# The first steps pay lazy initialization, allocator growth, compilation and DDP bucket rebuilding; they say
# nothing about the steady state. Dropped only when enough steps remain to measure without them.
WARMUP_STEPS = 2
MIN_STEPS_AFTER_WARMUP = 3
# Phases shorter than this are timer noise (perf_counter plus Python call overhead is ~10-100 µs).
MIN_PHASE_S = 1e-3
# A new expert placement is offered when, on the measured loads, it removes at least this share of the busiest
# rank's excess: below that the gain is within what the loads drift by between runs.
PLACEMENT_MIN_CUT = 0.2
# A smaller tp is offered when tensor parallelism's collectives are at least this share of the communication.
TP_MATERIAL = 0.25
