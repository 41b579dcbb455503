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
            os._exit(HANG_EXIT_CODE)
        hang_dir = self.run_dir / "hang"
        hang_dir.mkdir(parents=True, exist_ok=True)
        ranks = node_ranks(self.run_dir / "telemetry") or {self.rank: os.getpid()}
        collective: dict[str, bool] = {}
        for rank, pid in sorted(ranks.items()):
            dump = dump_stack(pid)
            (hang_dir / f"rank{rank:04d}.txt").write_text(dump)
            collective[str(rank)] = in_collective(dump)
        self.write(
            "hang", last_step=self.last_step, timeout_s=self.timeout_s, stacks_dir="hang", in_collective=collective
        )
        outside = [int(r) for r, c in collective.items() if not c]
        print(
            f"disttrain: no step completed in {self.timeout_s:.0f} s (last step {self.last_step}); stacks of ranks "
            f"{sorted(ranks)} in {hang_dir}; ranks not in a collective: {outside}",
            file=sys.stderr,
            flush=True,
        )
        if self.on_fire is not None:
            try:
                self.on_fire({"last_step": self.last_step, "timeout_s": self.timeout_s, "outside_collectives": outside})
            except Exception as err:  # the report is a bonus here; the abort must happen regardless
                print(f"disttrain: report after hang failed: {err}", file=sys.stderr, flush=True)
        for pid in ranks.values():
            if pid != os.getpid():
                with contextlib.suppress(ProcessLookupError):  # already gone is what we want
                    os.kill(pid, signal.SIGKILL)
        os._exit(HANG_EXIT_CODE)
