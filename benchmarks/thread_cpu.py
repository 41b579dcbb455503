"""Where a run's CPU goes, thread by thread: the hand-written loop against ``python -m train`` (Linux only).

``overhead.py`` compares wall-clock rates, and ``overhead_phases.py --clock thread`` the training thread's CPU
time; when those disagree, the difference is outside the training thread: another thread of a rank, another
process of the run, or the machine. This benchmark runs the same arms as ``overhead.py`` (rotated every repeat)
while a thread of its own reads every descendant thread's CPU time from ``/proc`` twice a second. Only the
steady intervals count: those in which every rank's main thread ran for more than half of it and another of its
threads ran too (training and communicating, not start-up or teardown). Per arm, the median over repeats of
each group's CPU in cores (CPU seconds per second): the ranks' training (main) threads, the ranks' other threads
by name (gloo's, torch's, Python's), the run's other processes (launcher side, resource tracker), this
benchmark's own process (the sampler), the rest of the machine (``/proc/stat`` busy time beyond the run's) and
steal (time the hypervisor gave to other guests).
Equal groups with unequal step times mean the difference is not work of ours that this clock can see. So the
ranks' training threads also get their wall time split three ways per step (``/proc/<pid>/schedstat`` and the
voluntary context switches in ``status``): on a CPU, runnable but waiting for one (CPU contention), and blocked
(waiting in a collective, on a lock, in a sleep), with the number of blocking waits per step: an extra sync
point of ours shows as one more wait per step, contention as queued time.

    python benchmarks/thread_cpu.py                                   # ddp, 100 steps, 2 repeats
    python benchmarks/thread_cpu.py --strategy fsdp --repeats 3 --extra diagnostics.profile=false
    python benchmarks/thread_cpu.py --arms diagnostics=off diagnostics.profile=false   # any arms, rotated
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import REPO, Rates, disttrain_cli, hand_written, run_overrides

from disttrain.config.parse import parse_run_config
from disttrain.strategies.layout import world_layout

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
ARMS = ["hand-written", "diagnostics=off", "diagnostics=default"]


@dataclass
class Sample:
    """Cumulative CPU seconds at one instant: per (pid, tid) with the thread's name, and the machine's."""

    at_s: float
    threads: dict[tuple[int, int], tuple[str, float]]
    machine_busy_s: float
    steal_s: float
    # Main threads only (schedstat, in ns): seconds on a CPU, seconds runnable but waiting for one, and voluntary
    # context switches (each a blocking wait: a collective, a lock, a sleep). They split wall time three ways.
    waits: dict[tuple[int, int], tuple[float, float, int]] = field(default_factory=dict)


def descendants(root: int) -> list[int]:
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                todo += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:  # it exited between the listing and the read
            continue
    return found


def thread_times(pid: int) -> dict[tuple[int, int], tuple[str, float]]:
    times = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        times[pid, int(tid)] = (name, (int(fields[11]) + int(fields[12])) * TICK_S)  # utime + stime
    return times


def main_thread_waits(pid: int) -> tuple[float, float, int] | None:
    """A process's main thread: seconds on a CPU and runnable but not running (schedstat), voluntary switches."""
    try:
        running_ns, queued_ns = (int(v) for v in Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[:2])
        status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    except (OSError, ValueError):  # gone, or a kernel without schedstats
        return None
    switches = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt"))
    return running_ns * 1e-9, queued_ns * 1e-9, switches


def machine_times() -> tuple[float, float]:
    """All CPUs' busy seconds (user, nice, system, irq, softirq) and steal seconds since boot."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return (user + nice + system + irq + softirq) * TICK_S, steal * TICK_S


@dataclass
class TreeSampler:
    """Samples this process and all its descendants every ``period_s`` in a daemon thread."""

    period_s: float = 0.5
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> TreeSampler:
        self._thread = threading.Thread(target=self._loop, name="thread-cpu-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            threads: dict[tuple[int, int], tuple[str, float]] = {}
            waits: dict[tuple[int, int], tuple[float, float, int]] = {}
            for pid in descendants(os.getpid()):
                threads.update(thread_times(pid))
                if (main := main_thread_waits(pid)) is not None:
                    waits[pid, pid] = main
            self.samples.append(Sample(time.perf_counter(), threads, *machine_times(), waits=waits))
            self._stop.wait(self.period_s)


TRAIN = "training threads (all ranks)"
QUEUED = "training threads: runnable, waiting for a CPU"
BLOCKED = "training threads: blocked (collectives, locks)"
SWITCHES = "training threads: blocking waits per second"


def steady_cores(samples: list[Sample], world: int) -> dict[str, float]:
    """Each group's CPU in cores over the steady intervals: at least ``world`` processes (the ranks) each had its
    main thread busy for more than half of the interval and another of its threads running (communication),
    which start-up (imports, building, one process after the other) does not have.

    The ranks' main threads also get their wall time's other two parts, in cores: runnable but waiting for a CPU
    (``QUEUED``), and blocked (``BLOCKED``: the rest of the interval), with their blocking waits per second."""
    own = os.getpid()
    seconds: dict[str, float] = defaultdict(float)
    span = 0.0
    for before, after in pairwise(samples):
        dt = after.at_s - before.at_s
        used = {
            key: (name, cpu - before.threads[key][1])
            for key, (name, cpu) in after.threads.items()
            if key in before.threads
        }
        busy = {pid for (pid, tid), (_, d) in used.items() if pid == tid != own and d > 0.5 * dt}
        talking = {pid for (pid, tid), (_, d) in used.items() if pid != tid and d > 0}
        ranks = busy & talking
        if len(ranks) < world:
            continue
        span += dt
        for (pid, tid), (name, d) in used.items():
            if pid == own:
                group = "this benchmark (sampler)"
            elif pid not in ranks:
                group = "the run's other processes"
            elif pid == tid:
                group = TRAIN
            else:
                group = f"rank threads: {name}"
            seconds[group] += d
        for pid in ranks:
            if (pid, pid) in after.waits and (pid, pid) in before.waits:
                now, then = after.waits[pid, pid], before.waits[pid, pid]
                running, queued, switches = (a - b for a, b in zip(now, then, strict=True))
                seconds[QUEUED] += queued
                seconds[BLOCKED] += max(0.0, dt - running - queued)
                seconds[SWITCHES] += switches
        run_total = sum(d for _, d in used.values())
        seconds["rest of the machine"] += max(0.0, after.machine_busy_s - before.machine_busy_s - run_total)
        seconds["steal (other guests)"] += after.steal_s - before.steal_s
    return {group: s / span for group, s in seconds.items()} if span else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--extra", nargs="*", default=[], help="extra `python -m train` overrides for every arm")
    parser.add_argument("--arms", nargs="+", default=ARMS, help="hand-written, or one `python -m train` override each")
    args = parser.parse_args()
    if not Path("/proc/self/task").is_dir():
        raise SystemExit("thread_cpu.py reads /proc: Linux only")
    overrides = run_overrides(args.steps, [f"strategy={args.strategy}", *args.extra])
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        world = world_layout(parse_run_config(compose(config_name="train", overrides=overrides))).world_size
    arms = args.arms
    cores: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    steps_ms: dict[str, list[float]] = {arm: [] for arm in arms}
    for repeat in range(args.repeats):
        for arm in arms[repeat % len(arms) :] + arms[: repeat % len(arms)]:
            with TreeSampler() as sampler:
                rates: Rates = (
                    hand_written(overrides, world, min(10, args.steps // 10))
                    if arm == "hand-written"
                    else disttrain_cli([*overrides, arm])
                )
            cores[arm].append(steady_cores(sampler.samples, world))
            steps_ms[arm].append(1e3 * rates.step_time_p50_s)
            print(f"  repeat {repeat + 1} {arm}: median step {steps_ms[arm][-1]:.1f} ms", flush=True)
    groups = sorted({g for runs in cores.values() for run in runs for g in run})
    print(f"{args.strategy}, {world} ranks, {args.steps} steps, {args.repeats} repeats: cores over steady intervals")
    width = max(12, *(len(arm) + 2 for arm in arms))
    label = max(36, *(len(g) + 1 for g in groups))
    print(f"  {'group':<{label}}" + "".join(f"{arm:>{width}}" for arm in arms))
    for group in groups:
        row = [statistics.median(run.get(group, 0.0) for run in cores[arm]) for arm in arms]
        print(f"  {group:<{label}}" + "".join(f"{v:>{width}.3f}" for v in row))
    steps = [statistics.median(steps_ms[arm]) for arm in arms]
    print(f"  {'median step (ms)':<{label}}" + "".join(f"{v:>{width}.1f}" for v in steps))
    # Cores x step time: the time each rank's training thread spends per step on a CPU, queued for one, and blocked;
    # on CPU equal in every arm means the same work, and the other two say where a longer step waits.
    for row_name, group in [
        ("training CPU per step and rank (ms)", TRAIN),
        ("  waiting for a CPU (ms)", QUEUED),
        ("  blocked (ms)", BLOCKED),
        ("blocking waits per step and rank", SWITCHES),
    ]:
        per_step = [
            statistics.median(run.get(group, 0.0) * ms / world for run, ms in zip(cores[a], steps_ms[a], strict=True))
            for a in arms
        ]
        scale = 1e-3 if group == SWITCHES else 1.0  # a rate per second x ms per step
        print(f"  {row_name:<{label}}" + "".join(f"{v * scale:>{width}.1f}" for v in per_step))


if __name__ == "__main__":
    main()
