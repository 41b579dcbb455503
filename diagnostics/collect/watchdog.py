"""Hang watchdog: no completed step within ``timeout_s`` -> every local rank's stack, a ``hang`` record, abort.

Every rank runs one. Local rank 0 does the work for its node: it finds the PIDs of its node's ranks in their
``meta`` telemetry records, dumps each Python stack with py-spy into ``RUN_DIR/hang/``, marks which ranks
are inside a collective (a rank that is not is the likely culprit: the others are waiting for it), writes the
``hang`` record, lets the caller build the report, kills the other ranks and exits non-zero. Other local
ranks only exit themselves if nobody has ended them after a grace period.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

HANG_EXIT_CODE = 3
# Frames that mean "blocked in communication": explicit c10d calls, and autograd's backward, inside which DDP
# waits for its all-reduce buckets (py-spy shows only the Python frame that entered the C++ engine).
COLLECTIVE_MARKERS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "distributed_c10d",
    "wait_tensor",
    "_engine_run_backward",
    "run_backward",
    "_wait_batch_p2p",  # a pipeline stage waiting for its neighbour's activations or gradients (send/recv)
)
# A main thread in one of these waits for its DataLoader's worker processes to hand over a batch.
LOADER_WAIT_MARKERS = ("_try_get_data", "_MultiProcessingDataLoaderIter._get_data")
# torch names its DataLoader worker processes so (prctl), which tells them from other children of a rank.
LOADER_WORKER_NAME = "pt_data_worker"
# Top-level packages whose frames are the training stack's, not the user's (with the standard library).
TRAINING_STACK = frozenset({"torch", "lightning", "lightning_fabric", "pytorch_lightning", "disttrain", "diagnostics"})
GRACE_S = 30.0


def py_spy() -> str | None:
    beside_python = Path(sys.executable).with_name("py-spy")
    return str(beside_python) if beside_python.exists() else shutil.which("py-spy")


def dump_stack(pid: int, timeout_s: float = 20.0) -> str:
    """One process's Python stacks (all threads) via py-spy, or why it could not be taken."""
    tool = py_spy()
    if tool is None:
        return "py-spy not found: install it (pip install py-spy) to get stacks of hung ranks"
    try:
        done = subprocess.run([tool, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"py-spy dump of pid {pid} timed out after {timeout_s:.0f} s"
    return done.stdout + (f"\n[py-spy stderr]\n{done.stderr}" if done.stderr.strip() else "")


def main_thread_stack(dump: str) -> str:
    """The part of a py-spy dump that belongs to the main thread (where training runs)."""
    blocks = dump.split("\nThread ")
    for block in blocks[1:]:
        if "MainThread" in block.splitlines()[0]:
            return block
    return blocks[1] if len(blocks) > 1 else dump


def in_collective(dump: str) -> bool:
    stack = main_thread_stack(dump)
    return any(marker in stack for marker in COLLECTIVE_MARKERS)


def waits_on_loader(dump: str) -> bool:
    """Whether the dumped process's main thread waits for a batch from its DataLoader worker processes."""
    stack = main_thread_stack(dump)
    return any(marker in stack for marker in LOADER_WAIT_MARKERS)


def _library_frame(frame: str) -> bool:
    """Whether a py-spy frame ("function (path:line)") is in the standard library or the training stack, by the
    top-level package of its path (py-spy prints paths relative to their sys.path entry)."""
    path = frame.rpartition("(")[2].rstrip(")").rpartition(":")[0]
    top = Path(path).parts[0].removesuffix(".py") if path and not Path(path).is_absolute() else ""
    return top in sys.stdlib_module_names or top in TRAINING_STACK


def _main_frames(dump: str) -> list[str]:
    """The main thread's frames of a py-spy dump, innermost first."""
    return [line.strip() for line in main_thread_stack(dump).splitlines()[1:] if line.strip()]


def _user_frame(frames: list[str]) -> str:
    """The innermost frame in the user's code, else the innermost one; "" if none."""
    return next((f for f in frames if not _library_frame(f)), frames[0] if frames else "")


def top_frame(dump: str) -> str:
    """Where the main thread of a py-spy dump is: its innermost frame in the user's code (a dataset blocked in a
    read shows ``MyData.__getitem__``, not ``Condition.wait``), else its innermost frame; "" if none."""
    return _user_frame(_main_frames(dump))


def loader_workers(pid: int) -> list[int]:
    """PIDs of ``pid``'s DataLoader worker processes: its children named ``LOADER_WORKER_NAME``, and its forks that
    have not named themselves yet (a worker names itself first thing in its loop: one deadlocked right after its fork
    never does, and it is the one the rank waits for; a fork still runs its parent's command line, which a spawned
    helper such as a compile worker does not); Linux /proc only, elsewhere none."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            children += [int(c) for c in task.read_text().split()]
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        command = None
    workers = []
    for child in sorted(set(children)):
        with contextlib.suppress(OSError):
            named = Path(f"/proc/{child}/comm").read_text().strip() == LOADER_WORKER_NAME
            if named or Path(f"/proc/{child}/cmdline").read_bytes() == command:
                workers.append(child)
    return workers


def worker_frame(dump: str) -> str:
    """Where a DataLoader worker is: idle (waiting for an index), its innermost frame in the user's code inside its
    loop (a dataset's ``__getitem__``, a collate function), or, not in its loop at all, where it stopped after its
    fork. A worker's stack also holds the frames it inherited from the fork (the rank's training loop): those say
    nothing about the worker."""
    frames = _main_frames(dump)
    loop = next((i for i, f in enumerate(frames) if f.startswith("_worker_loop ")), None)
    if loop is None:
        if frames and frames[0].startswith("_launch (") and "popen_fork.py" in frames[0]:
            # Still inside os.fork (the child's Python never ran): CPython's fork deadlock.
            return (
                f"stuck inside its fork at {frames[0]} (CPython's fork deadlock gh-112275, Python before 3.11.10 or "
                "3.12: upgrade, or give the DataLoader multiprocessing_context='forkserver')"
            )
        return f"not in its worker loop (stopped after its fork) at {frames[0]}" if frames else ""
    inside = frames[:loop]
    if inside and inside[-1].startswith(("get (multiprocessing/queues.py", "Queue.get (multiprocessing/queues.py")):
        return "idle, waiting for an index"
    return _user_frame(inside) or frames[loop]


def kill_loader_workers(pid: int) -> None:
    """SIGKILL ``pid``'s DataLoader workers: one blocked in a dataset's read never checks that its rank is gone."""
    for worker in loader_workers(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)


def dump_with_loader_workers(pid: int) -> tuple[str, list[str] | None]:
    """A rank's stacks, and when its main thread waits for its DataLoader workers, theirs appended (a worker stuck
    in a dataset's ``__getitem__``, a collate function or deadlocked at its fork is the hang's real place), with
    where each worker is (``worker_frame``); None instead of that list when the rank does not wait on its loader."""
    dump = dump_stack(pid)
    if not waits_on_loader(dump):
        return dump, None
    frames = []
    for worker in loader_workers(pid):
        worker_dump = dump_stack(worker)
        dump += f"\n=== DataLoader worker process {worker} of pid {pid} ===\n{worker_dump}"
        frames.append(f"worker {worker}: {worker_frame(worker_dump) or 'at an unknown frame'}")
    return dump, frames


def node_ranks(telemetry_dir: Path) -> dict[int, int]:
    """rank -> pid for the ranks of this host, from their ``meta`` records."""
    host = socket.gethostname()
    ranks: dict[int, int] = {}
    for path in telemetry_dir.glob("rank*.jsonl"):
        with path.open(encoding="utf-8") as handle:
            for line in handle:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if record.get("kind") == "meta" and record.get("hostname") == host:
                    ranks[int(record["rank"])] = int(record["pid"])
                    break
    return ranks


class Watchdog(threading.Thread):
    def __init__(
        self,
        timeout_s: float,
        run_dir: Path,
        rank: int,
        local_rank: int,
        write: Callable[..., None],
        on_fire: Callable[[dict], None] | None = None,  # gets the hang: last_step, timeout_s, outside_collectives
    ) -> None:
        super().__init__(name="disttrain-watchdog", daemon=True)
        self.timeout_s = timeout_s
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.local_rank = local_rank
        self.write = write
        self.on_fire = on_fire
        self.last_step = 0
        self._last_beat = time.monotonic()
        self._stop_event = threading.Event()

    def beat(self, step: int) -> None:
        self.last_step = step
        self._last_beat = time.monotonic()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        # Sleep until the deadline the last beat set, not on a fixed tick: a 600 s timeout then wakes this thread
        # about once per 600 s instead of every second, and fires on time rather than up to a tick late.
        while True:
            left = self._last_beat + self.timeout_s - time.monotonic()
            if left <= 0:
                self.fire()
                return
            if self._stop_event.wait(left):
                return

    def fire(self) -> None:
        if self.local_rank != 0:
            # Local rank 0 dumps our stack and ends us; if it is itself gone, do not linger.
            time.sleep(GRACE_S)
            kill_loader_workers(os.getpid())
            os._exit(HANG_EXIT_CODE)
        hang_dir = self.run_dir / "hang"
        hang_dir.mkdir(parents=True, exist_ok=True)
        ranks = node_ranks(self.run_dir / "telemetry") or {self.rank: os.getpid()}
        collective: dict[str, bool] = {}
        on_loader: dict[str, list[str]] = {}
        for rank, pid in sorted(ranks.items()):
            dump, worker_frames = dump_with_loader_workers(pid)
            (hang_dir / f"rank{rank:04d}.txt").write_text(dump)
            collective[str(rank)] = in_collective(dump)
            if worker_frames is not None:
                on_loader[str(rank)] = worker_frames
        self.write(
            "hang",
            last_step=self.last_step,
            timeout_s=self.timeout_s,
            stacks_dir="hang",
            in_collective=collective,
            waiting_on_loader=on_loader,
        )
        outside = [int(r) for r, c in collective.items() if not c]
        loader = "".join(
            f"; rank {r} waits for its DataLoader workers ({', '.join(f) or 'none found'})"
            for r, f in on_loader.items()
        )
        print(
            f"disttrain: no step completed in {self.timeout_s:.0f} s (last step {self.last_step}); stacks of ranks "
            f"{sorted(ranks)} in {hang_dir}; ranks not in a collective: {outside}{loader}",
            file=sys.stderr,
            flush=True,
        )
        if self.on_fire is not None:
            try:
                self.on_fire({"last_step": self.last_step, "timeout_s": self.timeout_s, "outside_collectives": outside})
            except Exception as err:  # the report is a bonus here; the abort must happen regardless
                print(f"disttrain: report after hang failed: {err}", file=sys.stderr, flush=True)
        for pid in ranks.values():
            # A worker stuck in a read never notices its rank is gone: it would outlive the job forever.
            kill_loader_workers(pid)
            if pid != os.getpid():
                with contextlib.suppress(ProcessLookupError):  # already gone is what we want
                    os.kill(pid, signal.SIGKILL)
        os._exit(HANG_EXIT_CODE)
