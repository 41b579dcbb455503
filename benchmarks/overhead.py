"""Framework overhead: tokens/s of ``python -m train`` vs a hand-written PyTorch DDP loop.

Both sides train the same model on the same data with the same global batch, optimizer, schedule,
gradient clipping, process count and threads per process; both time only training steps after the same
warm-up. The hand-written side is measured in the same invocation, so the printed ratio is meaningful on a
noisy shared machine (run it twice if the ratio looks off).

    python benchmarks/overhead.py                 # default model, 2 gloo processes on CPU
    python benchmarks/overhead.py --steps 120 --extra model=gpt2-124m   # any train overrides
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from disttrain.config.parse import parse_run_config
from disttrain.config.validate import validate_run, world_layout
from disttrain.data.datamodule import TokenDataModule
from disttrain.data.sampling import ResumableShardedSampler
from disttrain.launch.local import free_port
from disttrain.models import build_model
from disttrain.models.module import lr_lambda, param_groups

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_cli import train_manifest

REPO = Path(__file__).resolve().parents[1]


def hand_written_worker(rank: int, world: int, port: int, overrides: list[str], warmup: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = parse_run_config(compose(config_name="train", overrides=overrides))
    plan = validate_run(cfg)
    torch.set_num_threads(cfg.trainer.num_threads or max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    data = TokenDataModule(cfg.data, cfg.model.seq_len, plan.micro_batch_size, plan.global_batch_size, 0)
    data.setup()
    sampler = ResumableShardedSampler(len(data.train_set), world, rank, cfg.trainer.seed)
    loader = iter(DataLoader(data.train_set, batch_size=plan.micro_batch_size, sampler=sampler, drop_last=True))
    model = DistributedDataParallel(build_model(cfg.model, seed=cfg.trainer.seed))
    o = cfg.optimizer
    optimizer = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, o.warmup_steps, cfg.trainer.max_steps, o.min_lr_ratio)
    )
    start = 0.0
    for step in range(cfg.trainer.max_steps):
        if step == warmup:
            start = time.perf_counter()
        for micro in range(plan.accumulation):
            inputs, targets = next(loader)
            logits = model(inputs)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
            if micro < plan.accumulation - 1:
                with model.no_sync():
                    (loss / plan.accumulation).backward()
            else:
                (loss / plan.accumulation).backward()
        if cfg.trainer.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
    elapsed = time.perf_counter() - start
    tokens = (cfg.trainer.max_steps - warmup) * plan.global_batch_size * cfg.model.seq_len
    if rank == 0:
        Path(out).write_text(json.dumps({"tokens_per_s": tokens / elapsed}))
    dist.destroy_process_group()


def hand_written(overrides: list[str], world: int, warmup: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.spawn(hand_written_worker, args=(world, free_port(), overrides, warmup, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())["tokens_per_s"]


def disttrain_cli(overrides: list[str]) -> float:
    return train_manifest(overrides)["result"]["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--extra", nargs="*", default=[], help="extra `python -m train` overrides for both sides")
    args = parser.parse_args()
    warmup = min(10, args.steps // 10)  # the same warm-up the Throughput callback skips
    overrides = [
        f"trainer.max_steps={args.steps}",
        f"trainer.val_every_n_steps={args.steps}",  # one validation at the end, excluded from timing
        "trainer.val_batches=1",
        f"trainer.ckpt_every_n_steps={args.steps}",
        f"trainer.log_every_n_steps={max(1, args.steps // 10)}",
        *args.extra,
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = parse_run_config(compose(config_name="train", overrides=overrides))
    world = world_layout(cfg).world_size
    baseline = hand_written(overrides, world, warmup)
    ours = disttrain_cli(overrides)
    print(f"hand-written DDP loop : {baseline:10,.0f} tokens/s")
    print(f"python -m train       : {ours:10,.0f} tokens/s")
    print(f"ratio (target >= 0.97): {ours / baseline:10.3f}")


if __name__ == "__main__":
    main()
