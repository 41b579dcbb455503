"""Framework overhead: tokens/s of ``python -m train`` vs a hand-written PyTorch loop (DDP or FSDP2).

Both sides train the same model on the same data with the same global batch, optimizer, schedule, gradient
clipping, process count and threads per process; both time only training steps after the same warm-up. Three
arms per strategy, interleaved in one invocation (hand-written, ``diagnostics=default``, ``diagnostics=off``,
rotated every repeat so no arm always runs first) because this machine drifts by several percent. Two rates
per run: the median step (tokens per step / the median optimizer step after the warm-up: the steady rate, which
a burst of other work on a shared machine hardly moves) and the whole run (tokens over the timed steps / their
seconds: a mean, one-off costs such as the profiler window included). For each, the ratio of the medians over
the repeats and the median of the ratios paired within a repeat, with their spread (min/max).

    python benchmarks/overhead.py                           # ddp and fsdp, default model, 2 gloo processes
    python benchmarks/overhead.py --strategies ddp --repeats 5
    python benchmarks/overhead.py --steps 120 --extra model=gpt2-124m   # any train overrides, both sides
    python benchmarks/overhead.py --extra hw=8xh200 hw.devices_per_node=1 precision=bf16-mixed   # one GPU

On a GPU profile (``hw.accelerator: gpu``) the hand-written side runs NCCL, one device per process, under the
run's autocast dtype, and synchronises the device where its clock starts and stops.

The hand-written loops are what a user would write without the framework: ``DistributedDataParallel`` with
``no_sync`` over accumulated micro-batches, or FSDP2 ``fully_shard`` on each transformer block and then the
root (the layout ``strategy=fsdp`` builds) with gradient sync off until the last micro-batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hydra import compose, initialize_config_dir
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from disttrain.config.parse import parse_run_config
from disttrain.config.strategy_schema import FSDPConfig
from disttrain.data.datamodule import TokenDataModule
from disttrain.data.sampling import ResumableShardedSampler
from disttrain.launch.local import free_port
from disttrain.models import build_model
from disttrain.models.module import (
    compiled_next_token_loss,
    lr_lambda,
    next_token_loss,
    param_groups,
    use_fused_adamw,
)
from disttrain.strategies.layout import validate_run, world_layout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cli import spread, train_manifest

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"diagnostics=default": 0.97, "diagnostics=off": 0.99}


class WithLoss(torch.nn.Module):
    """The model with its loss in one forward: what a hand-written compiled loop compiles (nanoGPT's recipe)."""

    def __init__(self, model: torch.nn.Module, loss: Callable = next_token_loss) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model(inputs), targets)


def wrap(
    model: torch.nn.Module, strategy: object, world: int, device: torch.device, compile_model: bool
) -> torch.nn.Module:
    """The model and its loss, under DDP (compiled whole before wrapping, as nanoGPT does) or FSDP2 on one
    data-parallel mesh (a unit per transformer block, then the root; each block compiled first and the loss
    compiled apart, as torchtitan does)."""
    model = model.to(device)
    if not isinstance(strategy, FSDPConfig):
        with_loss: torch.nn.Module = WithLoss(model)
        if compile_model:
            with_loss = torch.compile(with_loss)  # type: ignore[assignment]
        return DistributedDataParallel(with_loss, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for index, block in enumerate(model.blocks):
        if compile_model:
            block = model.blocks[index] = torch.compile(block)
        fully_shard(block, mesh=mesh, reshard_after_forward=strategy.reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return WithLoss(model, compiled_next_token_loss() if compile_model else next_token_loss)


def sync_gradients(model: torch.nn.Module, on: bool) -> object:
    """A context in which backward all-reduces / reduce-scatters gradients only if ``on``."""
    import contextlib

    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if on else model.no_sync()
    model.model.set_requires_gradient_sync(on)  # type: ignore[operator]
    return contextlib.nullcontext()


@dataclass
class HandWrittenLoop:
    """What a hand-written training loop sets up on one rank: config, batch plan, loader, model, optimizer."""

    cfg: Any
    plan: Any
    device: torch.device
    loader: Iterator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LambdaLR


def set_up_hand_written(rank: int, world: int, port: int, overrides: list[str]) -> HandWrittenLoop:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = parse_run_config(compose(config_name="train", overrides=overrides))
    plan = validate_run(cfg)
    torch.set_num_threads(cfg.trainer.num_threads or max(1, (os.cpu_count() or 1) // world))
    on_gpu = cfg.hw.accelerator == "gpu"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=world)
    data = TokenDataModule(cfg.data, cfg.model.seq_len, plan.micro_batch_size, plan.global_batch_size, 0)
    data.setup()
    sampler = ResumableShardedSampler(len(data.train_set), world, rank, cfg.trainer.seed)
    loader = iter(DataLoader(data.train_set, batch_size=plan.micro_batch_size, sampler=sampler, drop_last=True))
    compile_model = bool(cfg.model.compile)
    model = wrap(build_model(cfg.model, seed=cfg.trainer.seed), cfg.strategy, world, device, compile_model)
    o = cfg.optimizer
    groups = param_groups(model, o.weight_decay)
    fused = use_fused_adamw([p for g in groups for p in g["params"]], o.fused) or None
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, o.warmup_steps, cfg.trainer.max_steps, o.min_lr_ratio)
    )
    return HandWrittenLoop(cfg, plan, device, loader, model, optimizer, schedule)


def hand_written_worker(rank: int, world: int, port: int, overrides: list[str], warmup: int, out: str) -> None:
    loop = set_up_hand_written(rank, world, port, overrides)
    cfg, plan, device, loader, model, optimizer, schedule = (
        loop.cfg,
        loop.plan,
        loop.device,
        loop.loader,
        loop.model,
        loop.optimizer,
        loop.schedule,
    )
    on_gpu = device.type == "cuda"
    if cfg.precision.name not in ("fp32", "bf16-mixed"):
        raise SystemExit(f"overhead.py: precision={cfg.precision.name} has no hand-written side (fp32, bf16-mixed)")
    dtype = torch.bfloat16 if cfg.precision.name == "bf16-mixed" else None
    start = last = 0.0
    step_times = []
    for step in range(cfg.trainer.max_steps):
        if step == warmup:
            if on_gpu:
                torch.cuda.synchronize()
            start = last = time.perf_counter()
        for micro in range(plan.accumulation):
            inputs, targets = (t.to(device, non_blocking=True) for t in next(loader))
            with (
                sync_gradients(model, micro == plan.accumulation - 1),
                torch.autocast(device.type, dtype=dtype, enabled=dtype is not None),
            ):
                (model(inputs, targets) / plan.accumulation).backward()
        if cfg.trainer.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if step >= warmup:
            now = time.perf_counter()
            step_times.append(now - last)
            last = now
    if on_gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens_per_step = plan.global_batch_size * cfg.model.seq_len
    if rank == 0:
        rates = Rates((cfg.trainer.max_steps - warmup) * tokens_per_step / elapsed, statistics.median(step_times))
        Path(out).write_text(json.dumps(rates.__dict__))
    dist.destroy_process_group()


@dataclass
class Rates:
    """One run's throughput: over the whole timed run (a mean), and its median step (the steady rate)."""

    tokens_per_s: float
    step_time_p50_s: float


def hand_written(overrides: list[str], world: int, warmup: int) -> Rates:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.spawn(hand_written_worker, args=(world, free_port(), overrides, warmup, out), nprocs=world, join=True)
        return Rates(**json.loads(Path(out).read_text()))


def run_overrides(steps: int, extra: list[str]) -> list[str]:
    """What both sides of a comparison run: ``steps`` steps, one validation and one checkpoint at the end."""
    return [
        f"trainer.max_steps={steps}",
        f"trainer.val_every_n_steps={steps}",  # one validation at the end, excluded from timing
        "trainer.val_batches=1",
        f"trainer.ckpt_every_n_steps={steps}",
        f"trainer.log_every_n_steps={max(1, steps // 10)}",
        *extra,
    ]


def disttrain_cli(overrides: list[str]) -> Rates:
    result = train_manifest(overrides)["result"]
    return Rates(result["tokens_per_s"], result["step_time_p50_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    parser.add_argument("--extra", nargs="*", default=[], help="extra `python -m train` overrides for both sides")
    args = parser.parse_args()
    warmup = min(10, args.steps // 10)  # the same warm-up the Throughput callback skips
    common = run_overrides(args.steps, args.extra)
    arms = ["hand-written", *TARGETS]
    runs: dict[tuple[str, str], list[Rates]] = {(s, a): [] for s in args.strategies for a in arms}
    tokens_per_step: dict[str, int] = {}
    for repeat in range(args.repeats):
        for strategy in args.strategies:
            overrides = [*common, f"strategy={strategy}"]
            with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
                cfg = parse_run_config(compose(config_name="train", overrides=overrides))
            world = world_layout(cfg).world_size
            tokens_per_step[strategy] = validate_run(cfg).global_batch_size * cfg.model.seq_len
            for arm in arms[repeat % len(arms) :] + arms[: repeat % len(arms)]:
                if arm == "hand-written":
                    rates = hand_written(overrides, world, warmup)
                else:
                    rates = disttrain_cli([*overrides, arm])
                runs[strategy, arm].append(rates)
                print(
                    f"  repeat {repeat + 1} {strategy} {arm}: {rates.tokens_per_s:,.0f} tokens/s over the run, "
                    f"median step {1e3 * rates.step_time_p50_s:.1f} ms",
                    flush=True,
                )
    print(f"{args.steps} steps, {args.repeats} interleaved repeats; tokens/s, median over repeats (min/max off it)")
    print_ratios("median step (steady rate: tokens per step / median step time)", runs, tokens_per_step, "median")
    print_ratios("whole run (tokens over the timed steps / their seconds)", runs, tokens_per_step, "whole")


def print_ratios(
    title: str, runs: dict[tuple[str, str], list[Rates]], tokens_per_step: dict[str, int], how: str
) -> None:
    """Each arm's median rate and spread; for the train arms the ratio of medians to the hand-written loop and the
    median (with spread) of the ratios paired within a repeat, which cancel drift slower than one repeat."""
    print(title)
    for strategy, step_tokens in tokens_per_step.items():

        def rate(r: Rates, step_tokens: int = step_tokens) -> float:
            return step_tokens / r.step_time_p50_s if how == "median" else r.tokens_per_s

        base_runs = [rate(r) for r in runs[strategy, "hand-written"]]
        base = statistics.median(base_runs)
        for arm in ["hand-written", *TARGETS]:
            values = [rate(r) for r in runs[strategy, arm]]
            line = f"  {strategy:<5} {arm:<20}: {statistics.median(values):10,.0f}  ({spread(values)})"
            if arm in TARGETS:
                paired = [v / b for v, b in zip(values, base_runs, strict=True)]
                line += (
                    f"  ratio of medians {statistics.median(values) / base:.3f}, paired {statistics.median(paired):.3f}"
                    f" ({min(paired):.3f}..{max(paired):.3f}; target >= {TARGETS[arm]})"
                )
            print(line)


if __name__ == "__main__":
    main()
