"""Can this machine resolve a 1-3% difference? Identical work, timed over and over, should take identical time.

Each process (as many as the benchmarks' ranks, one torch thread each) multiplies the same matrices in fixed-size
chunks for a while and records every chunk's wall and thread-CPU time. Reported: how much the same chunk's time
moves (p10..p90 off the median), and how much the median of a benchmark-run-sized window (``--window-s``) moves
between windows. Where the second is larger than the difference a benchmark is to show, its ratios need more
interleaved repeats than that window count, or a quieter machine; no change of ours can move it.

    python benchmarks/machine_noise.py                    # 2 processes, 60 s
    python benchmarks/machine_noise.py --processes 1 --seconds 120 --window-s 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cli import spread


def chunks(seconds: float, size: int, per_chunk: int) -> list[tuple[float, float, float]]:
    """(start, wall s, thread-CPU s) of each chunk of ``per_chunk`` matrix products."""
    torch.set_num_threads(1)
    a, b = torch.randn(size, size), torch.randn(size, size)
    timed: list[tuple[float, float, float]] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(per_chunk):
            torch.mm(a, b)
        timed.append((t0 - start, time.perf_counter() - t0, time.thread_time() - c0))
    return timed


def _worker(rank: int, seconds: float, size: int, per_chunk: int, results: dict) -> None:
    results[rank] = chunks(seconds, size, per_chunk)


def deciles(values: list[float]) -> str:
    """p10 and p90 as percentages off the median."""
    mid = statistics.median(values)
    cuts = statistics.quantiles(values, n=10)
    return f"{100 * (cuts[0] / mid - 1):+.1f}%/{100 * (cuts[-1] / mid - 1):+.1f}%"


def window_medians(timed: list[tuple[float, float, float]], window_s: float, column: int) -> list[float]:
    windows: dict[int, list[float]] = {}
    for row in timed:
        windows.setdefault(int(row[0] // window_s), []).append(row[column])
    return [statistics.median(v) for v in windows.values() if len(v) >= 3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--window-s", type=float, default=15.0, help="about one benchmark run's timed steps")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--per-chunk", type=int, default=100)
    args = parser.parse_args()
    if args.window_s * 2 > args.seconds:
        parser.error("--window-s must fit at least twice into --seconds")

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(args.seconds, args.size, args.per_chunk, results), nprocs=args.processes, join=True)
        per_process = [results[rank] for rank in range(args.processes)]

    print(f"{args.processes} process(es), {args.per_chunk} products of {args.size}x{args.size} per chunk:")
    for rank, timed in enumerate(per_process):
        for column, clock in ((1, "wall"), (2, "thread CPU")):
            values = [row[column] * 1e3 for row in timed]
            windows = window_medians(timed, args.window_s, column)
            print(
                f"  process {rank} {clock:>10}: {len(values)} chunks, median {statistics.median(values):.1f} ms, "
                f"p10/p90 {deciles(values)}, min/max {spread(values)}; "
                f"{len(windows)} windows of {args.window_s:.0f} s: medians {spread(windows)}"
            )
    print(
        "Identical work: a ratio between benchmark arms means something only where it is further from 1 than the "
        "windows' spread of medians above."
    )


if __name__ == "__main__":
    main()
