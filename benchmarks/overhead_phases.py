"""Where a step's time goes: per-phase medians of a hand-written loop vs ``python -m train``, interleaved.

Both sides time the same phases on rank 0 (data wait, forward + loss, backward, optimizer: clipping, the step,
zero_grad, the schedule; ``other``: everything between two steps) and report the median over steps after a
20-step warm-up, then the median over repeats. ``python -m train`` is timed by its own step records
(``diagnostics.profile=false``: the always-on collectors, whose own cost is ~0.1% of a step).

``--clock thread`` reads every timer as the training thread's CPU time (a ``sitecustomize`` on the ranks'
PYTHONPATH replaces ``time.perf_counter`` with ``time.thread_time``): the thread's own work, which other
processes on a shared machine disturb far less than they disturb wall-clock ratios. Waiting (for the other
rank, in a collective) then shows as less time, not more, so compare phases, not step totals, between clocks.

    python benchmarks/overhead_phases.py [--strategy ddp|fsdp] [--repeats 3] [--steps 100] [--clock wall|thread]
        [--extra strategy.gradient_as_bucket_view=false ...]   # any train overrides, both sides
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import set_up_hand_written
from train_cli import spread, train_manifest

from disttrain.launch.local import free_port

PHASES = ["step_s", "data_wait_s", "forward_s", "backward_s", "optimizer_s", "other_s"]
WARMUP_STEPS = 20
THREAD_CLOCK = "import time\ntime.perf_counter = time.thread_time\n"


def medians(rows: list[dict[str, float]]) -> dict[str, float]:
    rows = rows[WARMUP_STEPS:]
    return {phase: statistics.median(row.get(phase, 0.0) for row in rows) for phase in PHASES}


def hand_written_worker(rank: int, world: int, port: int, overrides: list[str], out: str) -> None:
    """The loop of overhead.py (accumulation 1), with a clock read between its phases."""
    loop = set_up_hand_written(rank, world, port, overrides)
    cfg, loader, model, optimizer, schedule = loop.cfg, loop.loader, loop.model, loop.optimizer, loop.schedule
    rows = []
    last = time.perf_counter()
    for _ in range(cfg.trainer.max_steps):
        t0 = time.perf_counter()
        inputs, targets = next(loader)
        t1 = time.perf_counter()
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        if cfg.trainer.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        t4 = time.perf_counter()
        rows.append(
            {"step_s": t4 - last, "data_wait_s": t1 - t0, "forward_s": t2 - t1, "backward_s": t3 - t2}
            | {"optimizer_s": t4 - t3, "other_s": t0 - last}
        )
        last = t4
    if rank == 0:
        Path(out).write_text(json.dumps(medians(rows)))
    dist.destroy_process_group()


def hand_written(overrides: list[str], world: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "phases.json")
        mp.spawn(hand_written_worker, args=(world, free_port(), overrides, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def disttrain_cli(overrides: list[str]) -> dict[str, float]:
    found: dict[str, dict[str, float]] = {}

    def inspect(run_dir: Path) -> None:
        lines = (run_dir / "telemetry" / "rank0000.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        found["phases"] = medians([r for r in records if r.get("kind") == "step"])

    train_manifest([*overrides, "diagnostics=default", "diagnostics.profile=false"], inspect=inspect)
    return found["phases"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clock", default="wall", choices=["wall", "thread"])
    parser.add_argument("--extra", nargs="*", default=[], help="extra `python -m train` overrides for both sides")
    args = parser.parse_args()
    overrides = [
        f"trainer.max_steps={args.steps}",
        f"trainer.val_every_n_steps={args.steps}",
        "trainer.val_batches=1",
        f"trainer.ckpt_every_n_steps={args.steps}",
        f"strategy={args.strategy}",
        *args.extra,
    ]
    world = 2
    with tempfile.TemporaryDirectory() as site:
        if args.clock == "thread":  # every rank of both sides inherits it (spawned and launched processes alike)
            Path(site, "sitecustomize.py").write_text(THREAD_CLOCK)
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
        arms = {
            "hand-written": lambda: hand_written(overrides, world),
            "python -m train": lambda: disttrain_cli(overrides),
        }
        results: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
        for repeat in range(args.repeats):
            order = list(arms) if repeat % 2 == 0 else list(arms)[::-1]
            for arm in order:
                results[arm].append(arms[arm]())
                print(f"  repeat {repeat + 1} {arm}: step {1e3 * results[arm][-1]['step_s']:.1f} ms", flush=True)
    print(f"{args.strategy}, {args.steps} steps, {args.repeats} repeats, {args.clock} clock: ms per step on rank 0")
    print(f"{'phase':<12} {'hand-written':>13} {'python -m train':>16} {'difference':>11}  spread (train)")
    for phase in PHASES:
        hand = statistics.median(r[phase] for r in results["hand-written"]) * 1e3
        ours = statistics.median(r[phase] for r in results["python -m train"]) * 1e3
        values = [r[phase] for r in results["python -m train"]]
        shown = spread(values) if min(values) > 0 else "-"
        print(f"{phase:<12} {hand:13.2f} {ours:16.2f} {ours - hand:+11.2f}  {shown}")


if __name__ == "__main__":
    main()
