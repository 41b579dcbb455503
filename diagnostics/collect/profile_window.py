"""One short torch.profiler window per rank, parsed into communication vs computation vs overlap vs idle.

What counts as communication: NCCL kernels on GPU; on CPU/gloo the ``gloo:*`` events on gloo's worker
threads (they include waiting), ``c10d``/``record_param_comms`` calls, ``_c10d_functional::wait_tensor``
(tensor parallel), and the ``FSDP::*`` / ``PP:*`` annotations around all-gathers and pipeline transfers.
DDP's wait for the last buckets at the end of backward has no event: it shows up as idle time.
"""

from __future__ import annotations

import bisect
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from diagnostics.collect.comm_bytes import collective_bytes, profiler_options
from diagnostics.collect.intervals import Interval, difference, split_window

COMM_PATTERN = re.compile(
    r"^(gloo:|nccl|ncclDevKernel|ncclKernel|c10d::|record_param_comms|_c10d_functional::|FSDP::|PP:|"
    r"All(Reduce|Gather)|ReduceScatter)|nccl",
    re.IGNORECASE,
)
# Markers that span whole steps or are Lightning/Python wrappers: they are not work in themselves.
WRAPPER_PATTERN = re.compile(r"^(ProfilerStep|\[pl\]|## |Optimizer\.zero_grad|cudaDeviceSynchronize)")


@dataclass(frozen=True)
class Event:
    name: str
    start_s: float
    end_s: float
    on_device: bool  # a GPU kernel (as opposed to a host-side op)
    category: str = "cpu_op"  # the trace's "cat": cpu_op, kernel, user_annotation, python_function, ...
    thread: object = 0  # the trace's (pid, tid): a host thread, or a GPU stream


# Annotations wrap other work (Lightning runs forward and backward inside the optimizer-step closure, so
# "Optimizer.step#..." spans whole steps): only real ops and kernels count as compute.
WRAPPER_CATEGORIES = {"user_annotation", "gpu_user_annotation", "python_function", "Trace"}


def is_comm(name: str) -> bool:
    return bool(COMM_PATTERN.search(name))


def split_events(events: list[Event], window: Interval) -> dict:
    """Seconds of compute, comm, overlap and idle in ``window``; on GPU only device kernels count as work."""
    use_device = any(e.on_device for e in events)
    work = [e for e in events if e.on_device == use_device or (not use_device and not e.on_device)]
    compute_by_thread: dict[object, list[Interval]] = {}
    comm_by_thread: dict[object, list[Interval]] = {}
    by_op: dict[str, float] = {}
    for event in work:
        if is_comm(event.name):
            comm_by_thread.setdefault(event.thread, []).append((event.start_s, event.end_s))
            key = event.name.split("(")[0][:60]
            by_op[key] = by_op.get(key, 0.0) + (event.end_s - event.start_s)
        elif event.category not in WRAPPER_CATEGORIES and not WRAPPER_PATTERN.search(event.name):
            compute_by_thread.setdefault(event.thread, []).append((event.start_s, event.end_s))
    # A thread blocked in a collective it called (a tensor-parallel wait_tensor) computes nothing meanwhile, though
    # the op that called it (an autograd node, a DTensor dispatch) spans the wait: that time is the thread's
    # communication, not compute the communication overlapped. Only such leaf waits (no op of the thread starts
    # inside them) are taken out: a pipeline action's annotation or an asynchronous send's span holds real compute.
    # Other threads' compute (the training thread's backward beside gloo's worker threads) does overlap them.
    compute = [
        i
        for t, spans in compute_by_thread.items()
        for i in difference(spans, blocking_waits(comm_by_thread.get(t, []), spans))
    ]
    comm = [i for spans in comm_by_thread.values() for i in spans]
    # Annotations on CPU (FSDP::, gloo:) are host events even on a GPU run: count them as comm too.
    if use_device:
        comm += [(e.start_s, e.end_s) for e in events if not e.on_device and e.name.startswith("FSDP::")]
    result: dict = split_window(compute, comm, window)
    result["comm_by_op"] = dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:10])
    result["backend"] = "device kernels" if use_device else "host ops"
    return result


def blocking_waits(comm: list[Interval], compute: list[Interval]) -> list[Interval]:
    """The communication spans of one thread inside which none of its compute ops starts."""
    starts = sorted(start for start, _ in compute)
    return [(s, e) for s, e in comm if bisect.bisect_left(starts, s) == bisect.bisect_left(starts, e)]


DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def events_from_trace(trace: dict) -> tuple[list[Event], Interval]:
    """Events and the profiled steps' span from an exported Chrome trace.

    Reading the exported JSON is ~30x cheaper than ``prof.events()``, which builds a Python object per op
    (about a second for three steps of even a tiny model): this keeps the window cheap enough to leave on.
    """
    events: list[Event] = []
    steps: list[Interval] = []
    for item in trace.get("traceEvents", []):
        if item.get("ph") != "X" or "dur" not in item:
            continue
        name = str(item.get("name", ""))
        start = float(item["ts"]) / 1e6
        end = start + float(item["dur"]) / 1e6
        if name.startswith("ProfilerStep"):
            steps.append((start, end))
            continue
        category = str(item.get("cat", ""))
        thread = (item.get("pid"), item.get("tid"))
        events.append(Event(name, start, end, category in DEVICE_CATEGORIES, category, thread))
    if not steps:
        raise RuntimeError("the profiler window recorded no steps")
    return events, (min(s for s, _ in steps), max(e for _, e in steps))


def release_cupti_after_window() -> None:
    """Have Kineto detach CUPTI when a profiling session stops (``TEARDOWN_CUPTI=1``; a value already set wins).

    By default Kineto leaves CUPTI attached once it has profiled, and every kernel launch after the window pays
    for it (the H200 A/B that showed it: benchmarks/RESULTS.md, "On one GPU"). Kineto
    reads it when it first initialises and when a session stops, so each process sets it before its first
    profiler. torch.compile's CUDA-graph mode sets it to 0 (CUPTI teardown breaks CUDA graphs on older CUDA):
    that setting stands.
    """
    os.environ.setdefault("TEARDOWN_CUPTI", "1")


class ProfilerWindow:
    """Profiles ``active`` optimizer steps after ``wait`` steps; ``close`` writes the ``profile`` record."""

    def __init__(
        self,
        wait: int,
        active: int,
        trace_dir: Path,
        rank: int,
        write: Callable[..., None],
        use_cuda: bool,
        all_threads: bool = True,
    ) -> None:
        import torch

        release_cupti_after_window()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if use_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.trace_file = trace_dir / f"rank{rank:04d}.trace.json"
        self.write = write
        # The profiler's step k ends with optimizer step k: after ``wait`` steps and one warm-up step, the window
        # records optimizer steps wait + 2 ... wait + 1 + active.
        self.first_step = wait + 2
        self.active = active
        self.done = False
        self.stopped = False
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=wait, warmup=1, active=active, repeat=1),
            on_trace_ready=self._ready,
            **profiler_options(all_threads),  # tensor shapes on every collective: the bytes they carry
        )
        trace_dir.mkdir(parents=True, exist_ok=True)
        self.profiler.__enter__()

    def _ready(self, prof: object) -> None:
        # Exporting and parsing the trace takes about a second on a CPU; training does not wait for it: the
        # recorded window stays in the profiler until ``close`` (train end) exports and parses it.
        self.done = True

    def _export_and_parse(self) -> None:
        self.profiler.export_chrome_trace(str(self.trace_file))
        trace = json.loads(self.trace_file.read_text())
        events, window = events_from_trace(trace)
        split = split_events(events, window)
        steps = [self.first_step, self.first_step + self.active - 1]
        by_op = {op: value / self.active for op, value in collective_bytes(trace).items()}
        self.write(
            "profile",
            steps=steps,
            trace_file=self.trace_file.name,
            comm_bytes_per_step=sum(by_op.values()),
            comm_bytes_by_op=by_op,
            **split,
        )

    def step(self) -> None:
        if self.done:
            return
        self.profiler.step()
        if self.done:
            # Stopped the moment the window completes, not left entered to the end of training (with
            # profile_all_threads it instruments gloo's threads too). The training thread's CPU per step after
            # the window was the same either way (thread clock, 2 runs each); the wall-clock medians that first
            # suggested a ~3% residue were this box's drift. The export and parse wait for close().
            self._stop()

    def _stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.profiler.__exit__(None, None, None)

    def close(self) -> None:
        """Stop profiling; a completed window is exported to the run dir and its ``profile`` record written."""
        self._stop()
        if self.done:
            self._export_and_parse()
