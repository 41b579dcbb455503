"""Per-step phase timing on one rank, without synchronising with the other ranks.

Data wait is the time inside the dataloader's ``next()``, which Lightning brackets with profiler actions
(``DataWaitProfiler``). The other phases come from Lightning's hook order: batch start -> forward -> before/
after backward -> before optimizer step -> batch end; whatever else happens between two steps (hooks,
logging) is ``other_s``. Validation and checkpoint writes are pauses, not step time (``Pause``): a save in a
step's end hooks is taken out of that step, and one between steps moves the next step's start to its end.

DDP all-reduces during backward and waits for the last buckets at its end, so backward wall time mixes compute with
waiting for slower ranks. A callback autograd runs once the backward's last gradient is computed (queued from the
loss's gradient hook, ahead of DDP's and FSDP2's own end-of-backward callbacks) marks when this rank's own backward
compute ended, for any model; the rest of backward is exposed communication and waiting for the last rank. Where it
does not fire (an engine running backward outside autograd's graph task) the whole backward counts as compute, and
the comm wait is read from the profiler window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lightning.pytorch.profilers import Profiler

# The op an MoE layer names the exchanges that end its experts' compute (models/moe.ALL_TO_ALL_AFTER_EXPERTS: the
# model reports ops by name, so the collectors need no import of it).
ALL_TO_ALL_AFTER_EXPERTS = "all_to_all_after_experts"


@dataclass
class StepPhases:
    data_wait_s: float = 0.0
    # The training thread's CPU time inside next(dataloader): near the wait when the loader computes its batches on
    # this thread (a CPU-bound __getitem__), near zero when it waits on I/O or on worker processes.
    data_cpu_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    backward_compute_s: float = 0.0
    optimizer_s: float = 0.0
    pipeline_wait_s: float = 0.0  # pipeline schedules: time inside the schedule computing nothing (bubble, p2p)
    pipelined: bool = False
    # Time inside the collectives a phase calls itself (FSDP2's all-gathers in forward, its all-gathers and
    # reduce-scatters in backward before this rank's own compute ends; collect/fsdp_comm): a fast rank's wait for
    # a slow one lands here, not in its own work. Zero where nothing times them (DDP, or FSDP on a GPU stream).
    forward_comm_s: float = 0.0
    backward_comm_s: float = 0.0
    # ZeRO-3's optimizer step gathers and reduces too (gradient norm, overflow check, parameter gathers): a fast
    # rank's wait for a slow one's step lands here.
    optimizer_comm_s: float = 0.0
    # Of those, the time inside expert parallelism's all-to-alls (token dispatch and combine, forward and backward):
    # the report's all-to-all share.
    all_to_all_s: float = 0.0
    # Each of those collectives' seconds, in the order this rank issued them (every rank issues the same ones in the
    # same order): the analysis takes each call's minimum over the ranks, the transfer without anyone's wait.
    comm_calls_s: list[float] = field(default_factory=list)
    all_to_all_calls_s: list[float] = field(default_factory=list)
    # Positions in all_to_all_calls_s of the exchanges that end the experts' compute (where a rank waits for the
    # peer holding busier experts); the others come before it (routing, attention: the same work on every rank).
    all_to_all_after_experts: list[int] = field(default_factory=list)
    # False when an engine ran the step's micro-batches itself (schedule_ran): Lightning's phase hooks did not
    # bracket its forward and backward, so which phase a collective fell in is unknown.
    phase_comm_known: bool = True
    step_s: float = 0.0
    # Unix time the step started (the previous step's end): ranks on one host share the clock, so the analysis
    # can tell which rank reached each phase end last (the order of arrival; see diagnostics/kinds/straggler).
    start_t: float = 0.0

    @property
    def local_compute_s(self) -> float:
        return self.forward_s + self.backward_compute_s + self.optimizer_s

    @property
    def comm_wait_s(self) -> float:
        """Backward time after this rank's own gradients were ready: waiting on the gradient all-reduce."""
        return max(0.0, self.backward_s - self.backward_compute_s)

    @property
    def other_s(self) -> float:
        """Step time outside data, forward, backward and optimizer: hooks, logging, checkpoint writes."""
        accounted = self.data_wait_s + self.forward_s + self.backward_s + self.optimizer_s + self.pipeline_wait_s
        return max(0.0, self.step_s - accounted)

    @property
    def bubble_fraction(self) -> float | None:
        """Share of the step a pipeline rank spent idle inside its schedule; None without pipelining."""
        return self.pipeline_wait_s / self.step_s if self.pipelined and self.step_s > 0 else None


@dataclass(frozen=True)
class Pause:
    """Time the training loop spent outside its steps: validation, or a checkpoint write."""

    what: str  # "validation" | "checkpoint"
    seconds: float
    start_t: float  # Unix time it began (ranks on one host share the clock)


@dataclass
class PhaseTimer:
    """Accumulates micro-batch phases into the current optimizer step; ``finish_step`` returns and resets."""

    clock: object = time.perf_counter
    wall_clock: object = time.time
    current: StepPhases = field(default_factory=StepPhases)
    _last_step_end: float | None = None
    _last_step_end_wall: float = 0.0
    _batch_start: float = 0.0
    _backward_start: float = 0.0
    _grad_ready: float | None = None
    _optimizer_start: float | None = None
    # Where this rank is now (one of diagnostics.crash.PHASES): a crash record names it.
    phase: str = "other"
    # The pause under way: (what, start, its Unix time, whether it began inside a step not yet finished).
    _pause: tuple[str, float, float, bool] | None = None
    _paused_in_step_s: float = 0.0
    _step_open: bool = False  # a phase of the next step was timed since the last finish_step
    pauses: list[Pause] = field(default_factory=list)  # ended, not yet taken by the recorder

    def now(self) -> float:
        return self.clock()  # type: ignore[operator]

    def pause_started(self, what: str) -> None:
        """Validation or a checkpoint write began. Inside a step (a save from the step's end hooks, before
        ``finish_step``) its time is taken out of that step; between steps the next step starts when it ends.
        A pause inside another (a checkpoint saved from validation's hooks) is part of the outer one."""
        if self._pause is not None:
            return
        now = self.now()
        if self._optimizer_start is not None:  # the optimizer step ended where the save began
            self.current.optimizer_s += now - self._optimizer_start
            self._optimizer_start = None
        start_t: float = self.wall_clock()  # type: ignore[operator]
        self._pause = (what, now, start_t, self._step_open)
        self.phase = what

    def pause_ended(self) -> None:
        """The pause under way (if any) ended now."""
        if self._pause is None:
            return
        what, start, start_t, inside = self._pause
        self._pause = None
        seconds = max(0.0, self.now() - start)
        self.pauses.append(Pause(what, seconds, start_t))
        if inside:
            self._paused_in_step_s += seconds
        elif self._last_step_end is not None:
            self._last_step_end += seconds
            self._last_step_end_wall += seconds
        self.phase = "other"

    def take_pauses(self) -> list[Pause]:
        taken, self.pauses = self.pauses, []
        return taken

    def data_fetched(self, seconds: float, cpu_seconds: float = 0.0) -> None:
        self._step_open = True
        self.current.data_wait_s += seconds
        self.current.data_cpu_s += cpu_seconds

    def batch_start(self) -> None:
        self.pause_ended()  # a save between steps ends, at the latest, where the next batch starts
        self._step_open = True
        self._batch_start = self.now()
        self.phase = "forward"

    def before_backward(self) -> None:
        now = self.now()
        self.current.forward_s += now - self._batch_start
        self._backward_start = now
        self._grad_ready = None
        self.phase = "backward"

    def grad_ready(self) -> None:
        """The input embedding's gradient is (about to be) computed: this rank's backward compute is done.

        The first call of a backward counts: FSDP2 runs the first parameter's post-accumulate-grad hook itself
        after its reduce-scatter (and the wait for the other ranks), which is communication, not compute.
        """
        if self._grad_ready is None:
            self._grad_ready = self.now()

    def after_backward(self) -> None:
        now = self.now()
        self.current.backward_s += now - self._backward_start
        end = self._grad_ready if self._grad_ready is not None and self._grad_ready <= now else now
        self.current.backward_compute_s += end - self._backward_start
        self.phase = "optimizer"  # gradient clipping and the non-finite check belong to the optimizer step

    def schedule_ran(self, forward_s: float, backward_s: float, wall_s: float, pipelined: bool) -> None:
        """A training step whose micro-batches an engine ran itself (Megatron's), outside Lightning's backward
        hooks: its forward and backward compute; under a pipeline schedule the rest of its wall time is the
        rank's wait inside the schedule (bubble and stage-to-stage transfers)."""
        self.current.forward_s += forward_s
        self.current.backward_s += backward_s
        self.current.backward_compute_s += backward_s
        self.current.phase_comm_known = False
        if pipelined:
            self.current.pipeline_wait_s += max(0.0, wall_s - forward_s - backward_s)
            self.current.pipelined = True

    def collective_ran(self, seconds: float) -> None:
        """A collective issued inside the current phase took ``seconds`` (transfer plus the wait for the others).

        In backward only until this rank's own compute ends: after that the whole rest of backward is already
        the comm wait (``comm_wait_s``), so counting it again would subtract it twice.
        """
        self._count_collective(seconds)

    def _count_collective(self, seconds: float) -> bool:
        """``collective_ran``; whether the call counted (it was issued inside forward or backward compute)."""
        if self.phase == "forward":
            self.current.forward_comm_s += seconds
        elif self.phase == "backward" and self._grad_ready is None:
            self.current.backward_comm_s += seconds
        else:
            if self.phase == "optimizer" and self._optimizer_start is not None:
                self.current.optimizer_comm_s += seconds  # kept apart: phase_comm's calls are forward/backward's
            return False
        self.current.comm_calls_s.append(seconds)
        return True

    def model_collective_ran(self, op: str, seconds: float) -> None:
        """A collective the model issued itself (an MoE layer's ``all_to_all`` or balancing ``all_reduce``)."""
        if self._count_collective(seconds) and op.startswith("all_to_all"):
            if op == ALL_TO_ALL_AFTER_EXPERTS:
                self.current.all_to_all_after_experts.append(len(self.current.all_to_all_calls_s))
            self.current.all_to_all_s += seconds
            self.current.all_to_all_calls_s.append(seconds)

    def before_optimizer_step(self) -> None:
        self._optimizer_start = self.now()
        self.phase = "optimizer"

    def batch_end(self) -> None:
        """A micro-batch inside gradient accumulation ended; its phases are already added to the step."""

    def finish_step(self) -> StepPhases | None:
        """Close the optimizer step that just ended; None for the very first (no previous end to measure from)."""
        self.pause_ended()  # a save from the step's end hooks ran before this
        now = self.now()
        self.phase = "other"
        if self._optimizer_start is not None:
            self.current.optimizer_s += now - self._optimizer_start
            self._optimizer_start = None
        done, previous_end, previous_wall = self.current, self._last_step_end, self._last_step_end_wall
        paused, self._paused_in_step_s, self._step_open = self._paused_in_step_s, 0.0, False
        self.current = StepPhases()
        self._last_step_end = now
        self._last_step_end_wall = self.wall_clock()  # type: ignore[operator]
        if previous_end is None:
            return None
        done.step_s = max(0.0, now - previous_end - paused)
        done.start_t = previous_wall
        return done

    def reset_clock(self) -> None:
        """Forget the last step end (after validation, whose time is not a training step's)."""
        self._last_step_end = None
        self._paused_in_step_s, self._step_open = 0.0, False
        self.current = StepPhases()


class DataWaitProfiler(Profiler):
    """Receives Lightning's profiler actions; forwards the duration of each training ``next(dataloader)``."""

    ACTION = "train_dataloader_next"

    def __init__(self) -> None:
        super().__init__()
        self.timer: PhaseTimer | None = None
        self._started: dict[str, tuple[float, float]] = {}

    def start(self, action_name: str) -> None:
        if action_name.endswith(self.ACTION):
            if self.timer is not None:
                self.timer.pause_ended()  # a save between steps ends where the next batch is fetched
                self.timer.phase = "data"
            self._started[action_name] = (time.perf_counter(), time.thread_time())

    def stop(self, action_name: str) -> None:
        started = self._started.pop(action_name, None)
        if started is not None and self.timer is not None:
            self.timer.data_fetched(time.perf_counter() - started[0], time.thread_time() - started[1])
            self.timer.phase = "other"

    def summary(self) -> str:
        return ""
