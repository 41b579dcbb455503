"""Named thresholds of the detectors, each with the reason for its value.

Fractions are of the mean step time of a rank after the warm-up steps are dropped. A finding needs both a
relative and (where noise matters) an absolute margin, so that microsecond phases of a tiny CPU run cannot
trigger it. The per-kind thresholds below decide whether a phenomenon is there at all (beyond noise); how bad
it is comes from its cost on the one scale that follows.
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

# input_bound: a prefetching loader hides data loading completely, so any visible wait is a symptom; 5% (the
# warning cost) is well above timer noise and the first-batch effect. It must hold in at least half of the steps:
# one slow batch is not a slow pipeline.
INPUT_BOUND_FRACTION = 0.05
INPUT_BOUND_PERSISTENCE = 0.5

# straggler, by order of arrival: per step, how much later than the earliest rank a rank reaches the end of each
# phase (its lateness). A rank that is slow in a phase falls behind during that phase; a rank that only waits
# for it at a collective never falls behind, it is caught up with. On a shared host every rank falls behind
# now and then (on the README's default run under load: ~70 ms a step each, the scheduler's choice), so what
# counts is how much more one rank falls behind than the others' median: at least 5% of the step (the warning
# cost) and in at least 70% of the steps (random preemption puts a rank behind in about half of them).
STRAGGLER_MIN_COST = 0.05
STRAGGLER_PERSISTENCE = 0.7
# Another rank is named beside the one that falls behind most only if it falls behind at least this share as much:
# a much smaller lag is what waiting inside an untimed collective leaves behind (4 ranks, gloo's broadcast tree: the
# rank relaying DDP's buffer broadcast to a late rank lagged 12 ms a step beside that rank's 79 ms) or what the
# scheduler hands out when ranks share cores. Fixing the first shows the next.
STRAGGLER_SECONDARY_SHARE = 1 / 3
# An intermittent straggler (kinds/straggler._stalls): a step in which one rank fell behind the others, beyond its usual
# excess, by at least STALL_FRACTION of the typical step and STALL_NOISE times the spread of its own excess (a robust
# standard deviation) is a stall; it takes MIN_STALLS of them to call it a pattern, not a one-off. On this 2-core box
# healthy 2-rank runs keep one rank's excess over the other within ~5% of the step; a fixed quarter of the step
# (before) missed stalls just under it that still cost 6% of a run (seed 3's stall-rank1-deepspeed-3: 27% of the step
# every 6 steps, excess 9 spreads above the usual). Four spreads, not five: a rank stalling in a quarter of its steps
# widens its own spread (seed 4's stall-rank0-ddp-builtin: stalls 4.6 spreads out, half of them missed at five; the
# four seeds re-judged at 4 and 5: no healthy run louder). Shared-host noise hits every rank alike: the rank named
# must also lose at least twice what any other rank loses to its own stalls. A pattern costing STALL_MIN_COST is
# reported as info below the warning cost: what the run's tail steps are, even where fixing it would gain little.
STALL_FRACTION = 0.10
STALL_NOISE = 4.0
MIN_STALLS = 3
STALL_MIN_COST = 0.02
# Records without phase start times (older collectors): a rank's local compute against the median of the other
# ranks; identical ranks on shared CPUs differ by ~5-10% from scheduling noise, 25% is outside that band.
STRAGGLER_RATIO = 1.25

# pauses: validation and checkpoint writes are work the user asked for, not a fault; below the warning cost their
# share of the loop is the price of that. Reported from PAUSES_MIN_SHARE, but graded on what rarer intervals can give
# back: each kind is only made rarer down to PAUSE_TARGET_SHARE of the loop (a run validates and saves for a reason;
# under 2% a rarer one saves less than two identical runs differ). The README's default run (4 validations of 8
# batches and 2 saves in 220 steps) spends 4-5% of its loop there (5.06% on a CI box): info, since 2-3 points of
# that are all the levers could return.
PAUSES_MIN_SHARE = COST_WARNING
PAUSE_TARGET_SHARE = 0.02

# comm_bound: exposed communication (the wait at the collective that is neither data nor local compute).
# The *minimum* over ranks is used, because every rank pays true communication while only the fast ranks pay
# waiting for a straggler. A quarter of the step in exposed communication is where overlap or fewer
# all-reduces per token start to pay; below it, low_overlap reports exposed communication.
COMM_BOUND_FRACTION = 0.25
# ... or saturated: the profiled communication per step needs at least 80% of the backward compute it can hide
# behind. Gradients become ready progressively, so the last buckets always trail the backward: at 80% there
# is no headroom left and any jitter is exposed (healthy DDP runs sit well below half).
COMM_SATURATION = 0.8

# low_overlap (profile window): less than 30% of communication hidden behind compute, while the exposed
# communication is at least 2% of the step (below that it is timer noise; the cost scale grades the rest). DDP
# bucketing and FSDP prefetching normally hide well over half of it.
LOW_OVERLAP_RATIO = 0.30
OVERLAP_MIN_COMM_FRACTION = 0.02

# memory_pressure: the caching allocator above 90% of device memory fragments and retries cudaMalloc
# (visible as slow steps); above 97% the next longer sequence or larger bucket is an OOM.
MEMORY_PRESSURE_FRACTION = 0.90
MEMORY_CRITICAL_FRACTION = 0.97

# throttling: share of a device's NVML samples that report a thermal or power clock slowdown. Brief power-cap
# dips are normal under load; a fifth of the run is a sustained clock loss. Its cost is that share times the
# clock lost in those samples (unknown clocks: the share itself, an upper bound).
THROTTLE_SAMPLE_FRACTION = 0.20

# host_overhead: step time that no phase accounts for (framework, Python, kernel launches), or the profiler's
# idle time. A tenth of the step is well above Lightning's per-step cost on any real model.
HOST_OVERHEAD_FRACTION = 0.10
# ... or a GPU that is mostly idle (NVML utilization) while neither data nor communication explains it.
LOW_DEVICE_UTIL_PCT = 50.0
EXPLAINED_WAIT_FRACTION = 0.10

# low_mfu: well-tuned dense transformer training reaches 35-55% MFU on current GPUs (PaLM 46%, Megatron
# 40-50%); below 20% something fixable (precision, batch size, host overhead) is usually in the way. Its cost is
# the step time that would go at 20% MFU, 1 - MFU/20%. Against a calibrated (measured matmul) peak the figure
# is less certain: reported as info.
LOW_MFU = 0.20

# pipeline_bubble: the idle share of a pipeline schedule, (pp-1)/(m+pp-1) for GPipe/1F1B. 15% is about what
# the common m = 4·pp microbatches cost (3/19 = 16% at pp=4); beyond it more microbatches pay.
BUBBLE_FRACTION = 0.15
# A run that crashed: its other findings rest on the steps before the crash. With fewer steps than this on a
# rank (after warm-up, typically only a start-up window and at most one profiler window) they are reported as
# info only; with more, at most as warnings: the crash is the thing to fix, the rest is measured on a run
# that did not finish.
CRASHED_RUN_MIN_STEPS = 10

# expert_imbalance: the most loaded expert-parallel rank computes this much more than the mean rank of its group
# (over the run's steady steps, summed over layers). Top-k routing of a freshly initialised router spreads tokens
# within a few percent of even (moe-micro on 2 ranks: 1-4%); 10% is outside that band.
EXPERT_IMBALANCE_MIN = 0.10
# A new expert placement is offered when, on the measured loads, it removes at least this share of the busiest
# rank's excess: below that the gain is within what the loads drift by between runs.
PLACEMENT_MIN_CUT = 0.2

# The all-to-alls are most of the phases' communication: token traffic, which neither accumulation nor gradient
# compression shrinks per token (recommend.for_comm_bound).
TOKENS_DOMINATE = 0.5
# The all-to-alls take at least this share of the step: fewer ranks per expert group (strategy.ep) is worth an
# A/B even while gradients are most of the traffic. moe-micro under FSDP on 2 CPU ranks: all-to-alls 14-15% of
# the step (40% of the phases' transfer) and ep=1 measured 16-23% faster than ep=2.
TOKENS_MATERIAL = 0.05

# comm_bound's levers by the part of the communication each shrinks (analysis/comm_split.py). Accumulation is
# offered when at least this share moves once per optimizer step: doubling it then saves a tenth of the exposed
# communication or more. Under FSDP2 (every micro-batch gathers and reduces) it saves none.
AMORTIZED_MIN = 0.2
# A smaller tp is offered when tensor parallelism's collectives are at least this share of the communication.
TP_MATERIAL = 0.25

# Under DDP the profile window's collectives stand for the gradients' (their saturation of backward, their share of a
# busy host's cores) only where the exposure it shows is within this factor of what the step records time every step.
WINDOW_AGREEMENT = 2.0
