"""Collector logic that can be checked without a training run: phase timing, interval math, profiler
event classification, hang stack classification, the CPU sampler."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from diagnostics.collect.callback import DiagnosticsCallback
from diagnostics.collect.intervals import intersection_total, split_window, total, union
from diagnostics.collect.profile_window import (
    Event,
    ProfilerWindow,
    is_comm,
    release_cupti_after_window,
    split_events,
)
from diagnostics.collect.run_facts import CollectSettings, RunFacts
from diagnostics.collect.sampler import CpuReader, make_reader
from diagnostics.collect.steps import PhaseTimer
from diagnostics.collect.watchdog import (
    Watchdog,
    in_collective,
    loader_workers,
    main_thread_stack,
    node_ranks,
    top_frame,
    waits_on_loader,
    worker_frame,
)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def test_interval_union_and_intersection() -> None:
    assert union([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert total([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert intersection_total([(0, 2), (3, 5)], [(1, 4)]) == pytest.approx(2.0)


def test_split_window_accounts_every_second() -> None:
    split = split_window(compute=[(0, 6)], comm=[(4, 8)], window=(0, 10))
    assert split == {"total_s": 10, "compute_s": 6, "comm_s": 4, "overlap_s": 2, "idle_s": 2}


def test_phase_timer_separates_compute_from_waiting_at_the_end_of_backward() -> None:
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    assert timer.finish_step() is None  # the first step end only starts the clock
    clock.advance(0.1)
    timer.data_fetched(0.1)  # Lightning timed 0.1 s inside next(dataloader)
    timer.batch_start()
    clock.advance(0.3)
    timer.before_backward()  # forward 0.3 s
    clock.advance(0.4)
    timer.grad_ready()  # backward compute 0.4 s ...
    clock.advance(0.5)
    timer.after_backward()  # ... then 0.5 s waiting for the all-reduce of slower ranks
    timer.before_optimizer_step()
    clock.advance(0.2)
    phases = timer.finish_step()  # optimizer 0.2 s
    assert phases is not None
    assert phases.step_s == pytest.approx(1.5)
    assert phases.data_wait_s == pytest.approx(0.1)
    assert phases.forward_s == pytest.approx(0.3)
    assert phases.backward_s == pytest.approx(0.9)
    assert phases.local_compute_s == pytest.approx(0.3 + 0.4 + 0.2)
    assert phases.comm_wait_s == pytest.approx(0.5)
    assert phases.other_s == pytest.approx(0.0)


def test_phase_timer_keeps_the_first_end_of_backward_compute_and_the_step_start_time() -> None:
    """FSDP2 calls the first parameter's post-accumulate hook itself after its reduce-scatter: the output-gradient
    hook, which fired first, is the end of compute; the later call must not turn the wait into compute."""
    clock, wall = FakeClock(), FakeClock()
    wall.advance(1_700_000_000.0)
    timer = PhaseTimer(clock=clock, wall_clock=wall)
    timer.finish_step()
    start = wall.t
    timer.batch_start()
    clock.advance(0.3), wall.advance(0.3)
    timer.before_backward()
    clock.advance(0.4), wall.advance(0.4)
    timer.grad_ready()  # the embedding output's gradient
    clock.advance(0.5), wall.advance(0.5)
    timer.grad_ready()  # FSDP2's post-reduce-scatter call of the parameter hook
    timer.after_backward()
    phases = timer.finish_step()
    assert phases is not None and phases.comm_wait_s == pytest.approx(0.5)
    assert phases.start_t == start  # on the host clock: the analysis orders the ranks' arrivals with it


def test_phase_timer_counts_collectives_in_the_phase_that_issued_them() -> None:
    """FSDP2's all-gathers and reduce-scatters (collect/fsdp_comm) land in forward_comm_s / backward_comm_s; in
    backward only until this rank's own compute ends, since the rest of backward is already the comm wait."""
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    timer.finish_step()
    timer.collective_ran(9.0)  # between steps (a logging sync): no phase of the step issued it
    timer.batch_start()
    timer.collective_ran(0.25)  # the next block's all-gather, waiting for a slow rank
    clock.advance(0.4)
    timer.before_backward()
    timer.collective_ran(0.1)
    clock.advance(0.5)
    timer.grad_ready()
    timer.collective_ran(0.3)  # the root's reduce-scatter after this rank's compute: comm wait already
    clock.advance(0.3)
    timer.after_backward()
    timer.collective_ran(0.7)  # after backward, before the optimizer step's clock starts: in no timed phase
    timer.before_optimizer_step()
    timer.collective_ran(0.05)  # ZeRO-3's step gathering the others' partitions
    clock.advance(0.1)
    phases = timer.finish_step()
    assert phases is not None
    assert (phases.forward_comm_s, phases.backward_comm_s) == (pytest.approx(0.25), pytest.approx(0.1))
    assert phases.optimizer_comm_s == pytest.approx(0.05) and phases.optimizer_s == pytest.approx(0.1)
    assert phases.comm_wait_s == pytest.approx(0.3) and phases.phase_comm_known
    timer.batch_start()
    timer.collective_ran(0.2)  # inside an engine's schedule: its backward ran under Lightning's "forward" phase
    timer.schedule_ran(0.1, 0.2, 0.5, pipelined=False)
    assert not timer.finish_step().phase_comm_known  # type: ignore[union-attr]


def test_phase_timer_keeps_an_moe_layers_collectives_call_by_call_and_its_all_to_alls_apart() -> None:
    """An MoE layer's all-to-alls and balancing all-reduce (collect/experts) count as the phase's collectives, one
    entry per call in issue order (the analysis takes each call's minimum over the ranks); all-to-alls also apart."""
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    timer.finish_step()
    timer.batch_start()
    timer.collective_ran(0.25)  # an FSDP2 all-gather
    timer.model_collective_ran("all_reduce", 0.05)  # the balancing loss's counts
    timer.model_collective_ran("all_to_all", 0.1)  # dispatch
    timer.model_collective_ran("all_to_all", 0.2)  # combine
    clock.advance(1.0)
    timer.before_backward()
    timer.model_collective_ran("all_to_all", 0.3)  # combine's reverse
    clock.advance(1.0)
    timer.grad_ready()
    timer.model_collective_ran("all_to_all", 7.0)  # after this rank's compute (not issued by an MoE layer there)
    timer.after_backward()
    phases = timer.finish_step()
    assert phases is not None
    assert phases.forward_comm_s == pytest.approx(0.6) and phases.backward_comm_s == pytest.approx(0.3)
    assert phases.all_to_all_s == pytest.approx(0.6)
    assert phases.comm_calls_s == pytest.approx([0.25, 0.05, 0.1, 0.2, 0.3])
    assert phases.all_to_all_calls_s == pytest.approx([0.1, 0.2, 0.3])
    assert timer.finish_step().comm_calls_s == []  # type: ignore[union-attr]  # each step starts empty


def test_phase_timer_sums_accumulated_micro_batches() -> None:
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    timer.finish_step()
    for _ in range(2):
        clock.advance(0.05)
        timer.data_fetched(0.05)
        timer.batch_start()
        clock.advance(0.1)
        timer.before_backward()
        clock.advance(0.2)
        timer.after_backward()  # no grad hook: all of backward counts as compute
        timer.batch_end()
    timer.before_optimizer_step()
    clock.advance(0.1)
    phases = timer.finish_step()
    assert phases is not None
    assert phases.data_wait_s == pytest.approx(0.1)
    assert phases.forward_s == pytest.approx(0.2)
    assert phases.backward_compute_s == pytest.approx(0.4)
    assert phases.step_s == pytest.approx(0.8)
    assert phases.comm_wait_s == pytest.approx(0.0)


def test_time_between_steps_that_is_not_data_is_other() -> None:
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    timer.finish_step()
    clock.advance(2.0)  # e.g. a checkpoint write after the previous step
    timer.batch_start()
    clock.advance(0.5)
    timer.before_backward()
    timer.after_backward()
    phases = timer.finish_step()
    assert phases is not None
    assert (phases.data_wait_s, phases.other_s) == pytest.approx((0.0, 2.0))


def test_data_wait_profiler_forwards_only_the_dataloader_action() -> None:
    from diagnostics.collect.steps import DataWaitProfiler

    timer = PhaseTimer(clock=FakeClock())
    profiler = DataWaitProfiler()
    profiler.timer = timer
    profiler.start("run_training_batch")
    profiler.stop("run_training_batch")
    assert timer.current.data_wait_s == 0.0
    profiler.start("[_TrainingEpochLoop].train_dataloader_next")
    profiler.stop("[_TrainingEpochLoop].train_dataloader_next")
    assert timer.current.data_wait_s > 0.0


def test_phase_timer_knows_which_phase_a_crash_would_interrupt() -> None:
    from diagnostics.collect.steps import DataWaitProfiler

    timer = PhaseTimer(clock=FakeClock())
    profiler = DataWaitProfiler()
    profiler.timer = timer
    seen = [timer.phase]
    profiler.start("[_TrainingEpochLoop].train_dataloader_next")
    seen.append(timer.phase)
    profiler.stop("[_TrainingEpochLoop].train_dataloader_next")
    for hook in (timer.batch_start, timer.before_backward, timer.after_backward, timer.before_optimizer_step):
        hook()
        seen.append(timer.phase)
    timer.finish_step()
    seen.append(timer.phase)
    assert seen == ["other", "data", "forward", "backward", "optimizer", "optimizer", "other"]


def test_profile_split_on_gloo_counts_worker_thread_collectives_as_comm() -> None:
    events = [
        Event("aten::mm", 0.0, 4.0, False),
        Event("aten::addmm", 1.0, 2.0, False),  # nested inside the mm span: union, not double counting
        Event("gloo:all_reduce", 3.0, 6.0, False, "user_annotation", "gloo worker"),
        Event("Optimizer.zero_grad#AdamW.zero_grad", 6.0, 6.5, False),
        Event("Optimizer.step#AdamW.step", 0.0, 9.0, False, "user_annotation"),  # wraps the whole closure
        Event("aten::add_", 7.0, 8.0, False),
    ]
    split = split_events(events, (0.0, 10.0))
    assert split["compute_s"] == pytest.approx(5.0)
    assert split["comm_s"] == pytest.approx(3.0)
    assert split["overlap_s"] == pytest.approx(1.0)
    assert split["idle_s"] == pytest.approx(3.0)
    assert split["comm_by_op"] == {"gloo:all_reduce": pytest.approx(3.0)}
    assert split["backend"] == "host ops"


def test_profile_split_on_gpu_uses_kernels() -> None:
    events = [
        Event("aten::mm", 0.0, 9.0, False),  # host launch spans are not GPU work
        Event("sm90_xmma_gemm_bf16", 1.0, 3.0, True),
        Event("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 2.0, 5.0, True, "kernel", "stream 2"),
    ]
    split = split_events(events, (0.0, 10.0))
    assert (split["compute_s"], split["comm_s"], split["overlap_s"]) == pytest.approx((2.0, 3.0, 1.0))
    assert split["backend"] == "device kernels"


def test_a_thread_blocked_in_its_own_collective_is_not_computing_under_the_op_that_called_it() -> None:
    """Tensor parallelism on gloo: the training thread waits in ``wait_tensor`` inside an autograd node (and
    DTensor's dispatch), whose span is an op. That wait is exposed communication, not overlap. A pipeline action's
    annotation, also comm by its name, holds the stage's compute: that compute stays compute."""
    main = "main"
    events = [
        Event("autograd::engine::evaluate_function: RedistributeBackward", 0.0, 4.0, False, "cpu_op", main),
        Event("aten::mm", 0.5, 1.5, False, "cpu_op", main),
        Event("_c10d_functional::wait_tensor", 2.0, 4.0, False, "cpu_op", main),  # blocked: 2 s exposed
        Event("gloo:all_reduce", 1.8, 4.0, False, "user_annotation", "gloo worker"),
        Event("PP:0F0", 5.0, 8.0, False, "user_annotation", main),  # a pipeline action: its forward inside
        Event("aten::addmm", 5.5, 7.5, False, "cpu_op", main),
    ]
    split = split_events(events, (0.0, 10.0))
    # Compute: 0-2 (the node before its wait) and 5.5-7.5; comm: 1.8-4 and 5-8.
    assert split["compute_s"] == pytest.approx(4.0)
    assert split["comm_s"] == pytest.approx(5.2)
    assert split["overlap_s"] == pytest.approx(0.2 + 2.0)  # the worker's start before the wait, the stage's compute
    assert split["comm_s"] - split["overlap_s"] == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("name", "comm"),
    [("gloo:all_gather", True), ("FSDP::all_gather", True), ("_c10d_functional::wait_tensor", True),
     ("record_param_comms", True), ("aten::mm", False), ("aten::native_layer_norm", False)],
)  # fmt: skip
def test_comm_event_names(name: str, comm: bool) -> None:
    assert is_comm(name) is comm


STACK_IN_ALLREDUCE = """Process 101: python -m train
Python v3.11.7

Thread 101 (idle): "MainThread"
    _engine_run_backward (torch/autograd/graph.py:829)
    backward (torch/autograd/__init__.py:353)
    training_step (disttrain/models/module.py:90)

Thread 140 (idle): "disttrain-sampler"
    wait (threading.py:331)
"""
STACK_SLEEPING = """Process 102: python -m train
Python v3.11.7

Thread 102 (idle): "MainThread"
    forward (my_model.py:12)
    _call_impl (torch/nn/modules/module.py:1784)
    training_step (disttrain/models/module.py:88)

Thread 150 (idle): "gloo-worker"
    all_reduce (torch/distributed/distributed_c10d.py:2800)
"""

STACK_IN_PIPELINE_RECV = """Process 103: python -m train
Python v3.11.7

Thread 103 (idle): "MainThread"
    _wait_batch_p2p (torch/distributed/pipelining/schedules.py:683)
    Schedule1F1B._step_microbatches (torch/distributed/pipelining/schedules.py:1067)
    MegatronEngine.forward_backward (disttrain/strategies/megatron/engine.py:278)
"""


STACK_WAITING_ON_LOADER = """Process 104: python -m train
Python v3.11.7

Thread 104 (idle): "MainThread"
    poll (multiprocessing/connection.py:257)
    get (multiprocessing/queues.py:113)
    _try_get_data (torch/utils/data/dataloader.py:1285)
    _get_data (torch/utils/data/dataloader.py:1447)
    _next_data (torch/utils/data/dataloader.py:1492)

Thread 160 (idle): "disttrain-sampler"
    wait (threading.py:331)
"""


def test_hang_stacks_tell_a_rank_waiting_on_its_loader_workers() -> None:
    assert waits_on_loader(STACK_WAITING_ON_LOADER) and not in_collective(STACK_WAITING_ON_LOADER)
    assert not any(waits_on_loader(s) for s in (STACK_IN_ALLREDUCE, STACK_SLEEPING, STACK_IN_PIPELINE_RECV))
    assert top_frame(STACK_WAITING_ON_LOADER) == "poll (multiprocessing/connection.py:257)"  # nothing of the user's
    worker = 'Thread 7 (idle): "MainThread"\n    wait (threading.py:327)\n    __getitem__ (my_data.py:40)\n'
    assert top_frame(worker) == "__getitem__ (my_data.py:40)"
    assert top_frame(STACK_SLEEPING) == "forward (my_model.py:12)"


def stack(*frames: str) -> str:
    """A py-spy main-thread dump with these frames, innermost first."""
    return 'Thread 7 (idle): "MainThread"\n' + "".join(f"    {f}\n" for f in frames)


# What a worker inherits from its fork: the rank's own frames below its worker loop.
INHERITED = ("Popen._launch (multiprocessing/popen_fork.py:71)", "__iter__ (lightning/pytorch/loops/fetchers.py:52)",
             "run_job (train.py:52)")  # fmt: skip
LOOP = ("_worker_loop (torch/utils/data/_utils/worker.py:334)", "BaseProcess.run (multiprocessing/process.py:108)")


def test_a_loader_workers_place_is_read_inside_its_loop_not_from_the_frames_its_fork_inherited() -> None:
    """A worker's stack ends in the rank's own frames (it was forked from the training loop): a CI hang read
    "worker at run_job (train.py:52)" for a worker that sat idle in its loop."""
    idle = stack(
        "poll (multiprocessing/connection.py:257)", "Queue.get (multiprocessing/queues.py:113)", *LOOP, *INHERITED
    )
    assert worker_frame(idle) == "idle, waiting for an index"
    fetch = "fetch (torch/utils/data/_utils/fetch.py:52)"
    reading = stack("wait (threading.py:327)", "__getitem__ (my_data.py:40)", fetch, *LOOP, *INHERITED)
    assert worker_frame(reading) == "__getitem__ (my_data.py:40)"
    forked = stack("acquire (threading.py:120)", "_bootstrap (multiprocessing/process.py:314)", *INHERITED)
    assert worker_frame(forked) == "not in its worker loop (stopped after its fork) at acquire (threading.py:120)"
    in_fork = stack(
        "_launch (multiprocessing/popen_fork.py:66)", "__init__ (multiprocessing/popen_fork.py:19)", *INHERITED
    )
    assert worker_frame(in_fork).startswith("stuck inside its fork at _launch (multiprocessing/popen_fork.py:66)")
    assert "gh-112275" in worker_frame(in_fork) and "forkserver" in worker_frame(in_fork)


def test_a_fork_that_has_not_named_itself_counts_as_a_loader_worker_a_spawned_helper_does_not() -> None:
    """A worker names itself pt_data_worker first thing in its loop; one deadlocked right after its fork never does."""
    import multiprocessing
    import subprocess
    import sys

    fork = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    fork.start()
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)  # the helper's exec
        workers = loader_workers(os.getpid())
        assert fork.pid in workers and helper.pid not in workers
    finally:
        fork.kill()
        helper.kill()
        fork.join()
        helper.wait()
    assert fork.pid not in loader_workers(os.getpid())


def test_hang_stacks_classify_the_rank_outside_collectives() -> None:
    assert in_collective(STACK_IN_ALLREDUCE)
    assert in_collective(STACK_IN_PIPELINE_RECV)  # waiting for the hung stage's activations
    assert not in_collective(STACK_SLEEPING)  # a collective on another thread does not count
    assert "forward (my_model.py:12)" in main_thread_stack(STACK_SLEEPING)


def test_node_ranks_come_from_meta_records(tmp_path: Path) -> None:
    import socket

    telemetry = tmp_path / "telemetry"
    telemetry.mkdir()
    for rank, host in ((0, socket.gethostname()), (1, socket.gethostname()), (2, "other-node")):
        record = {"kind": "meta", "rank": rank, "pid": 1000 + rank, "hostname": host}
        (telemetry / f"rank{rank:04d}.jsonl").write_text(json.dumps(record) + "\n{torn")
    assert node_ranks(telemetry) == {0: 1000, 1: 1001}


class RecordingWatchdog(Watchdog):
    """Records when it would dump stacks and end the ranks, instead of doing it."""

    def __init__(self, timeout_s: float, tmp_path: Path) -> None:
        super().__init__(timeout_s, tmp_path, rank=0, local_rank=0, write=lambda *a, **k: None)
        self.fired_at: float | None = None
        self.fired = threading.Event()

    def fire(self) -> None:
        self.fired_at = time.monotonic()
        self.fired.set()


def test_watchdog_fires_a_timeout_after_the_last_beat_and_not_while_steps_beat(tmp_path: Path) -> None:
    dog = RecordingWatchdog(1.0, tmp_path)
    dog.start()
    beating_until = time.monotonic() + 2.0  # two timeouts of steady beats: a fixed-deadline watchdog would fire
    while time.monotonic() < beating_until:
        dog.beat(7)
        time.sleep(0.05)
    last_beat = time.monotonic()
    dog.beat(8)
    assert not dog.fired.is_set()
    assert dog.fired.wait(10)
    assert dog.fired_at is not None and dog.fired_at - last_beat >= 1.0
    assert dog.last_step == 8
    dog.join(5)
    assert not dog.is_alive()


class CountingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return super().wait(timeout)


def test_watchdog_sleeps_until_its_deadline_and_stops_at_once(tmp_path: Path) -> None:
    dog = RecordingWatchdog(600, tmp_path)
    dog._stop_event = CountingEvent()
    dog.start()
    for step in range(15):  # 1.5 s of steps: a watchdog polling every second would have woken already
        dog.beat(step)
        time.sleep(0.1)
    dog.stop()
    dog.join(2)
    assert not dog.is_alive() and not dog.fired.is_set()
    assert dog._stop_event.waits == 1


def test_cpu_reader_is_labelled_and_reports_rss() -> None:
    reader, why = make_reader(None)
    assert isinstance(reader, CpuReader) and why is None
    sample = reader.read()
    assert sample["source"] == "cpu"
    assert sample["rss_bytes"] > 10 * 2**20
    assert sample["cpu_util_pct"] >= 0


def test_nvml_falls_back_to_cpu_with_a_reason_without_a_gpu() -> None:
    reader, why = make_reader(0)
    assert reader.source in {"nvml", "cpu"}
    if reader.source == "cpu":
        assert "NVML unavailable" in why


def test_events_from_an_exported_chrome_trace() -> None:
    from diagnostics.collect.profile_window import events_from_trace

    trace = {"traceEvents": [
        {"ph": "X", "name": "ProfilerStep#3", "cat": "user_annotation", "ts": 1_000_000, "dur": 2_000_000},
        {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "ts": 1_500_000, "dur": 500_000},
        {"ph": "X", "name": "ncclDevKernel_AllReduce", "cat": "kernel", "ts": 2_000_000, "dur": 250_000},
        {"ph": "i", "name": "marker", "ts": 1_200_000},
    ]}  # fmt: skip
    events, window = events_from_trace(trace)
    assert window == (1.0, 3.0)
    assert [(e.name, e.on_device) for e in events] == [("aten::mm", False), ("ncclDevKernel_AllReduce", True)]


def test_phase_timer_takes_a_pipeline_schedules_own_timing() -> None:
    """Megatron's engine runs every micro-batch inside one schedule call: its forward and backward compute are
    reported as such and the rest of the schedule's wall time is the rank's bubble, not host overhead."""
    clock = FakeClock()
    timer = PhaseTimer(clock=clock)
    timer.finish_step()
    timer.batch_start()
    clock.advance(1.0)
    timer.schedule_ran(forward_s=0.25, backward_s=0.45, wall_s=1.0, pipelined=True)
    timer.before_optimizer_step()
    clock.advance(0.1)
    phases = timer.finish_step()
    assert phases is not None
    assert (phases.forward_s, phases.backward_s, phases.comm_wait_s) == (0.25, 0.45, 0.0)
    assert phases.pipeline_wait_s == pytest.approx(0.3)
    assert phases.bubble_fraction == pytest.approx(0.3 / 1.1)
    assert phases.other_s == pytest.approx(0.0)
    timer.schedule_ran(forward_s=0.2, backward_s=0.3, wall_s=0.6, pipelined=False)  # tensor parallelism only
    clock.advance(0.6)
    unpipelined = timer.finish_step()
    assert unpipelined is not None and unpipelined.bubble_fraction is None
    assert unpipelined.other_s == pytest.approx(0.1)


def test_collector_reads_a_schedules_timing_from_the_module_once(tmp_path: Path) -> None:
    """A module whose engine runs the step's micro-batches itself (Megatron) offers their timing through
    ``pop_schedule_timing``; the collector takes it at the step's end, exactly once."""
    facts = RunFacts("megatron", "fp32", "fp32", "cpu", 10, 60.0, 60.0, 64, 2, 4, 8, 10, None)
    callback = DiagnosticsCallback(CollectSettings(), facts, tmp_path, lambda: None)
    timings = [SimpleNamespace(forward_s=0.25, backward_s=0.45, wall_s=1.0, pipelined=True)]
    module = SimpleNamespace(pop_schedule_timing=lambda: timings.pop() if timings else None)
    trainer = SimpleNamespace(global_step=3)
    callback._last_step = 3  # inside the step: the collector adds to it without closing it
    callback.on_train_batch_end(trainer, module, None, None, 0)
    callback.on_train_batch_end(trainer, module, None, None, 0)
    current = callback.timer.current
    assert (current.forward_s, current.backward_s, current.pipelined) == (0.25, 0.45, True)
    assert current.pipeline_wait_s == pytest.approx(0.3)
    callback.on_train_batch_end(trainer, SimpleNamespace(), None, None, 0)  # a module without an engine
    assert callback.timer.current.forward_s == 0.25


def test_profiler_window_stops_when_it_completes_and_writes_its_record_at_close(tmp_path: Path) -> None:
    """The profiler stops in the step its window completes (nothing of it stays active for the rest of training);
    the trace is exported and parsed at close, outside the timed steps."""
    records: list[tuple[str, dict]] = []
    window = ProfilerWindow(2, 2, tmp_path, 0, lambda kind, **f: records.append((kind, f)), use_cuda=False)
    x = torch.randn(16, 16, requires_grad=True)
    states = []
    for _ in range(8):
        (x @ x).sum().backward()
        window.step()
        states.append((window.done, window.stopped))
    assert states == [(False, False)] * 4 + [(True, True)] * 4  # exited in the step its window completed
    assert records == []  # the export and parse wait for close, outside the timed steps
    window.close()
    (kind, record), *_ = records
    assert kind == "profile" and record["steps"] == [4, 5] and (tmp_path / record["trace_file"]).is_file()


def test_profiler_window_asks_kineto_to_detach_cupti_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kineto keeps CUPTI attached after a session unless TEARDOWN_CUPTI=1; a value already set (a user's, or
    torch.compile's 0 under CUDA graphs) is left as it is."""
    monkeypatch.setenv("TEARDOWN_CUPTI", "")  # records the variable's state for undo, which delenv alone does not
    monkeypatch.delenv("TEARDOWN_CUPTI")
    window = ProfilerWindow(1, 1, tmp_path, 0, lambda kind, **f: None, use_cuda=False)
    window.close()
    assert os.environ["TEARDOWN_CUPTI"] == "1"
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")
    release_cupti_after_window()
    assert os.environ["TEARDOWN_CUPTI"] == "0"
