"""Named thresholds of the detectors, each with the reason for its value.

Fractions are of the mean step time of a rank after the warm-up steps are dropped. A finding needs both a
relative and (where noise matters) an absolute margin, so that microsecond phases of a tiny CPU run cannot
trigger it.
"""

from __future__ import annotations

# The first steps pay lazy initialization, allocator growth, compilation and DDP bucket rebuilding; they say
# nothing about the steady state. Dropped only when enough steps remain to measure without them.
WARMUP_STEPS = 2
MIN_STEPS_AFTER_WARMUP = 3

# Phases shorter than this are timer noise (perf_counter plus Python call overhead is ~10-100 µs).
MIN_PHASE_S = 1e-3

# input_bound: a prefetching loader hides data loading completely, so any visible wait is a symptom; 10% is
# well above timer noise and the first-batch effect, and enough that fixing it pays. At 30% the device idles a
# third of the run.
INPUT_BOUND_FRACTION = 0.10
INPUT_BOUND_CRITICAL_FRACTION = 0.30

# straggler: a rank's local compute (timed without waiting for others) against the median of the *other*
# ranks. Identical ranks on shared CPUs differ by ~5-10% from scheduling noise; 25% is outside that band.
# At 50% every other rank waits a third of its step for that one.
STRAGGLER_RATIO = 1.25
STRAGGLER_CRITICAL_RATIO = 1.50
# A straggler must be slow in at least this share of the all-gather windows: one noisy window is not a
# broken host.
STRAGGLER_PERSISTENCE = 0.5

# comm_bound: exposed communication (the wait at the collective that is neither data nor local compute).
# The *minimum* over ranks is used, because every rank pays true communication while only the fast ranks pay
# waiting for a straggler. A quarter of the step in exposed communication is where overlap or fewer
# all-reduces per token start to pay; at half the step the run is mostly moving gradients.
COMM_BOUND_FRACTION = 0.25
COMM_BOUND_CRITICAL_FRACTION = 0.50
# ... or saturated: the profiled communication per step needs at least 80% of the backward compute it can hide
# behind. Gradients become ready progressively, so the last buckets always trail the backward: at 80% there
# is no headroom left and any jitter is exposed (healthy DDP runs sit well below half).
COMM_SATURATION = 0.8

# low_overlap (profile window): less than 30% of communication hidden behind compute, while communication is
# at least 10% of the window. DDP bucketing and FSDP prefetching normally hide well over half of it.
LOW_OVERLAP_RATIO = 0.30
LOW_OVERLAP_CRITICAL_RATIO = 0.10  # essentially serialized: every byte moved is time the devices do not compute
OVERLAP_MIN_COMM_FRACTION = 0.10

# memory_pressure: the caching allocator above 90% of device memory fragments and retries cudaMalloc
# (visible as slow steps); above 97% the next longer sequence or larger bucket is an OOM.
MEMORY_PRESSURE_FRACTION = 0.90
MEMORY_CRITICAL_FRACTION = 0.97

# throttling: share of a device's NVML samples that report a thermal or power clock slowdown. Brief power-cap
# dips are normal under load; a fifth of the run is a sustained clock loss, half of it is a cooling/power
# problem of that node.
THROTTLE_SAMPLE_FRACTION = 0.20
THROTTLE_CRITICAL_FRACTION = 0.50

# host_overhead: step time that no phase accounts for (framework, Python, kernel launches), or the profiler's
# idle time. A quarter of the step is far above Lightning's per-step cost on any real model.
HOST_OVERHEAD_FRACTION = 0.25
HOST_OVERHEAD_CRITICAL_FRACTION = 0.50
# ... or a GPU that is mostly idle (NVML utilization) while neither data nor communication explains it.
LOW_DEVICE_UTIL_PCT = 50.0
EXPLAINED_WAIT_FRACTION = 0.10

# low_mfu: well-tuned dense transformer training reaches 35-55% MFU on current GPUs (PaLM 46%, Megatron
# 40-50%); below 20% something fixable (precision, batch size, host overhead) is usually in the way, below 10%
# almost certainly. Against a calibrated (measured matmul) peak the figure is less certain: reported as info.
LOW_MFU = 0.20
LOW_MFU_CRITICAL = 0.10

# pipeline_bubble: the idle share of a pipeline schedule, (pp-1)/(m+pp-1) for GPipe/1F1B. 15% is about what
# the common m = 4·pp microbatches cost (3/19 = 16% at pp=4); beyond it more microbatches pay. At 30% a third
# of the devices idle.
BUBBLE_FRACTION = 0.15
BUBBLE_CRITICAL_FRACTION = 0.30

# A run that crashed: its other findings rest on the steps before the crash. With fewer steps than this on a
# rank (after warm-up, typically only a start-up window and at most one profiler window) they are reported as
# info only; with more, at most as warnings: the crash is the thing to fix, the rest is measured on a run
# that did not finish.
CRASHED_RUN_MIN_STEPS = 10
