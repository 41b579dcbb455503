"""DataLoader workers forked while native threads enter Python: how many iterators hang, per defence.

CPython's fork deadlock (gh-112275, ``disttrain.reliability.fork_guard``) needs a native thread taking the
interpreter's thread-state lock at the instant of the fork. In a rank that is gloo's work thread after a
collective: rare per fork (one CI hang in some thousands of worker forks). Here ``--churners`` native threads enter
Python all the time (each a new pthread running a ctypes callback: a fresh thread state, as gloo's threads get one),
so the rare event is common enough to count, and each arm is the same loop:

- ``fork``: the loader as users build it (torch's default fork start);
- ``barrier``: the same with ``install_fork_barrier`` (the wait for the lock before each fork);
- ``guard``: ``guard_dataloader`` (the barrier plus workers that confirm they started, re-forked otherwise).

Each arm runs in its own process (an at-fork hook cannot be removed), arms interleaved per repeat. An iterator
"hangs" when its first batch does not come within ``--batch-timeout-s`` (torch's own timeout); ``re-forked`` counts
the guard's kills of a silent child. On an unaffected Python (3.12+, 3.11.10+) every arm should read 0 hangs.

    python benchmarks/fork_deadlock.py --iters 2000 --repeats 2
    python benchmarks/fork_deadlock.py --startup 40    # what the guard costs: time to a loader's first batch

``--startup N``: no churners; N interleaved pairs of a 2-worker loader's ``iter()`` + first batch, torch's fork
against the guard's (each worker's fork waits for the child's confirmation), median and spread of each.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ARMS = ("fork", "barrier", "guard")


def _start_churners(count: int) -> None:
    libc = ctypes.CDLL(None)
    start = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
    entered = start(lambda _: None)  # each call on a new native thread creates (and drops) a thread state
    libc.pthread_create.argtypes = [ctypes.POINTER(ctypes.c_ulong), ctypes.c_void_p, start, ctypes.c_void_p]
    libc.pthread_join.argtypes = [ctypes.c_ulong, ctypes.c_void_p]

    def churn() -> None:
        while True:
            tid = ctypes.c_ulong()
            libc.pthread_create(ctypes.byref(tid), None, entered, None)
            libc.pthread_join(tid.value, None)

    _start_churners.keep = entered  # type: ignore[attr-defined]  # the callback must outlive the threads
    for _ in range(count):
        threading.Thread(target=churn, daemon=True).start()


def run_arm(arm: str, iters: int, churners: int, batch_timeout_s: float, confirm_timeout_s: float) -> dict:
    import torch
    from torch.utils.data import DataLoader, Dataset

    from disttrain.reliability import fork_guard

    class Items(Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, index: int) -> torch.Tensor:
            return torch.tensor([index])

    fork_guard._ConfirmedForkPopen.confirm_timeout_s = confirm_timeout_s
    fork_guard._ConfirmedForkPopen.attempts = 10
    if arm == "barrier":
        fork_guard.install_fork_barrier()
    _start_churners(churners)
    hangs = 0
    started = time.perf_counter()
    for _ in range(iters):
        loader = DataLoader(Items(), batch_size=4, num_workers=2, timeout=batch_timeout_s)
        if arm == "guard":
            fork_guard.guard_dataloader(loader)
        try:
            batches = iter(loader)
            next(batches)
            del batches
        except RuntimeError:  # "DataLoader timed out after N seconds"
            hangs += 1
    return {
        "arm": arm,
        "iters": iters,
        "hangs": hangs,
        "reforked": fork_guard._ConfirmedForkPopen.reforked,
        "s": round(time.perf_counter() - started, 1),
    }


def startup(pairs: int, workers: int = 2) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from disttrain.reliability.fork_guard import CONFIRMED_FORK

    items = TensorDataset(torch.arange(64.0))
    times: dict[str, list[float]] = {"fork": [], "guard": []}
    for _ in range(pairs):
        for arm in times:
            loader = DataLoader(items, batch_size=4, num_workers=workers)
            if arm == "guard":
                loader.multiprocessing_context = CONFIRMED_FORK
            started = time.perf_counter()
            batches = iter(loader)
            next(batches)
            times[arm].append(1e3 * (time.perf_counter() - started))
            del batches
    for arm, ms in times.items():
        print(
            f"{arm:6s} first batch of a {workers}-worker loader: median {statistics.median(ms):.1f} ms "
            f"({min(ms):.1f}..{max(ms):.1f}) over {pairs}"
        )
    ratio = statistics.median(times["guard"]) / statistics.median(times["fork"])
    print(f"guard / fork: {ratio:.2f}; load {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000, help="DataLoader iterators per arm and repeat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--churners", type=int, default=4)
    parser.add_argument("--batch-timeout-s", type=float, default=5.0)
    parser.add_argument("--confirm-timeout-s", type=float, default=2.0)
    parser.add_argument("--startup", type=int, metavar="PAIRS", help="measure the guard's start-up cost instead")
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in its own process
    args = parser.parse_args()
    if args.startup:
        startup(args.startup)
        return
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.iters, args.churners, args.batch_timeout_s, args.confirm_timeout_s)))
        return
    from disttrain.reliability.fork_guard import fork_can_deadlock

    print(f"python {sys.version.split()[0]} (fork can deadlock: {fork_can_deadlock()}), load {os.getloadavg()[0]:.1f}")
    rows: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for _ in range(args.repeats):
        for arm in ARMS:
            command = [
                sys.executable,
                __file__,
                "--arm",
                arm,
                "--iters",
                str(args.iters),
                "--churners",
                str(args.churners),
                "--batch-timeout-s",
                str(args.batch_timeout_s),
                "--confirm-timeout-s",
                str(args.confirm_timeout_s),
            ]
            out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows[arm].append(row)
            print(f"  {arm:8s} hangs {row['hangs']:3d} of {row['iters']}  re-forked {row['reforked']:3d}  {row['s']} s")
    for arm in ARMS:
        hangs = [r["hangs"] for r in rows[arm]]
        print(
            f"{arm:8s} hung iterators per {args.iters}: median {statistics.median(hangs)} "
            f"({min(hangs)}..{max(hangs)}), total {sum(hangs)}; re-forked {sum(r['reforked'] for r in rows[arm])}"
        )
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
