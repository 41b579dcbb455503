"""Two gloo ranks train a tiny transformer once per DDP comm hook and once with 1-bit Adam, in one job (``python -m
tests.dist.comm_hooks_job OUT.json``): bytes handed to the collectives per step, final validation loss, and a
resume of each stateful one (PowerSGD, 1-bit Adam).

Bytes are measured at the process-group level by torch.profiler (``record_shapes``) and read with
``diagnostics.collect.comm_bytes``, the same parser the diagnostics window uses: whatever DDP or a hook hands to
gloo is counted, nothing is derived from the config. Rank 0 writes the results; the test asserts on them.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from diagnostics.collect.comm_bytes import collective_bytes, profiler_options
from disttrain.config.schema import ModelConfig
from disttrain.config.strategy_schema import DDPConfig
from disttrain.data.markov import MarkovSource
from disttrain.models import build_model
from disttrain.models.onebit_adam import OneBitAdam
from disttrain.strategies.comm_hooks import build_comm_hook
from disttrain.strategies.ddp import register_comm_hook
from disttrain.strategies.onebit import CompressedMean, OneBitComm, onebit_hook
from disttrain.strategies.powersgd import PowerSGDComm

WORLD = 2
MODEL = ModelConfig(n_layers=2, d_model=32, n_heads=2, ffn_hidden=64, vocab_size=16, seq_len=16)
HOOKS = ("none", "bf16", "fp16", "powersgd", "onebit")  # onebit: optimizer=onebit_adam (its own hook)
STATEFUL = ("powersgd", "onebit")
STEPS = 100
# An order-1 source: this 2-layer model learns it in a hundred steps, so losses can be compared near the floor.
ORDER = 1
MICRO = 8  # sequences per rank per step
PROFILE_FROM, PROFILE_STEPS = 22, 3  # after the warm-ups (PowerSGD, 1-bit Adam): the compressed path is measured
POWERSGD = {"powersgd_rank": 2, "powersgd_warmup_steps": 2}
ONEBIT_FREEZE = 20  # plain AdamW steps before the compressed momentum exchange: done before the profiled steps
RESUME_AT, RESUME_STEPS = 24, 6  # after both warm-ups
# A few buckets rather than one, so DDP really regroups them after its first step (what PowerSGD's state must
# survive); the whole model is ~80 KB.
BUCKET_CAP_MB = 0.02


def batches(source: MarkovSource) -> torch.Tensor:
    windows = source.sample(STEPS * WORLD * MICRO, MODEL.seq_len + 1, seed=1)
    return torch.from_numpy(windows.astype("int64")).reshape(STEPS, WORLD, MICRO, -1)


def make(hook: str, seed: int = 0) -> tuple[DistributedDataParallel, torch.optim.Optimizer, object | None]:
    model = build_model(MODEL, seed=seed)
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    if hook == "onebit":
        comm = OneBitComm(ONEBIT_FREEZE)
        register_comm_hook(ddp, comm, onebit_hook)
        return ddp, OneBitAdam(model.parameters(), comm, lr=1e-2, betas=(0.9, 0.999), eps=1e-8), comm
    state, fn = build_comm_hook(DDPConfig(comm_hook=hook, **POWERSGD), "gloo")
    register_comm_hook(ddp, state, fn)
    return ddp, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0), state


def step(ddp: DistributedDataParallel, opt: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    logits = ddp(batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


@torch.no_grad()
def val_loss(model: torch.nn.Module, val: torch.Tensor) -> float:
    logits = model(val[:, :-1])
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), val[:, 1:].reshape(-1)))


def profiled_bytes(ddp: DistributedDataParallel, opt: torch.optim.Optimizer, data: torch.Tensor, rank: int) -> dict:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], **profiler_options()) as prof:
        for s in range(PROFILE_FROM, PROFILE_FROM + PROFILE_STEPS):
            step(ddp, opt, data[s, rank])
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        by_op = collective_bytes(json.loads(trace.read_text()))
    return {op: value / PROFILE_STEPS for op, value in by_op.items()}


def train_hook(hook: str, data: torch.Tensor, val: torch.Tensor, rank: int) -> dict:
    ddp, opt, _ = make(hook)
    losses = [step(ddp, opt, data[s, rank]) for s in range(PROFILE_FROM)]
    per_step = profiled_bytes(ddp, opt, data, rank)
    losses += [step(ddp, opt, data[s, rank]) for s in range(PROFILE_FROM + PROFILE_STEPS, STEPS)]
    return {"bytes_per_step": per_step, "first_loss": losses[0], "val_loss": val_loss(ddp.module, val)}


def resume_matches(hook: str, data: torch.Tensor, rank: int) -> dict:
    """A stateful hook's per-rank state saved mid-run and loaded into a fresh DDP (one bucket at first) and optimizer
    continues bit for bit."""
    ddp, opt, comm = make(hook)
    for s in range(RESUME_AT):
        step(ddp, opt, data[s, rank])
    assert isinstance(comm, PowerSGDComm | OneBitComm)
    saved_state = comm.state_dict(WORLD)
    saved_model = {k: v.clone() for k, v in ddp.module.state_dict().items()}
    saved_opt = opt.state_dict()
    saved_opt = {"state": {k: {n: t.clone() for n, t in v.items()} for k, v in saved_opt["state"].items()},
                 "param_groups": saved_opt["param_groups"]}  # fmt: skip
    buckets_before = len(comm.layouts) if isinstance(comm, PowerSGDComm) else None
    for s in range(RESUME_AT, RESUME_AT + RESUME_STEPS):
        step(ddp, opt, data[s, rank])

    fresh, fresh_opt, fresh_comm = make(hook, seed=99)
    fresh.module.load_state_dict(saved_model)
    fresh_opt.load_state_dict(saved_opt)
    assert isinstance(fresh_comm, PowerSGDComm | OneBitComm)
    dropped = fresh_comm.load_state_dict(saved_state, WORLD)
    for s in range(RESUME_AT, RESUME_AT + RESUME_STEPS):
        step(fresh, fresh_opt, data[s, rank])
    pairs = zip(ddp.module.parameters(), fresh.module.parameters(), strict=True)
    diffs = [float((a - b).detach().abs().max()) for a, b in pairs]
    return {
        "max_abs_diff": max(diffs),
        "dropped": dropped,
        "buckets_before": buckets_before,
        "saved_errors": len(saved_state["error"]) if hook == "powersgd" else int(saved_state["numel"]),
        "saved_q": len(saved_state["q"]) if hook == "powersgd" else None,
    }


def analytic(rank_r: int) -> dict:
    """Payload per step from the parameter shapes: all gradients, or PowerSGD's factors plus what it leaves alone."""
    model = build_model(MODEL, seed=0)
    numel = sum(p.numel() for p in model.parameters())
    compressed = uncompressed = 0
    for p in model.parameters():
        n = p.shape[0]
        m = p.numel() // n
        r = min(n, m, rank_r)
        if (n + m) * r * 2 < n * m:  # torch's min_compression_rate=2 rule
            compressed += (n + m) * r
        else:
            uncompressed += p.numel()
    onebit = CompressedMean(numel, torch.device("cpu"))  # in the job's world of WORLD ranks
    return {
        "numel": numel,
        "powersgd_elements": compressed + uncompressed,
        "compressed_elements": compressed,
        "onebit_bytes_per_phase": onebit.bytes_per_phase,
    }


def worker(rank: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        source = MarkovSource(MODEL.vocab_size, ORDER, 0.05, 1234)
        data = batches(source)
        val = torch.from_numpy(source.sample(512, MODEL.seq_len + 1, seed=2).astype("int64"))
        result = {hook: train_hook(hook, data, val, rank) for hook in HOOKS}
        result["analytic"] = analytic(POWERSGD["powersgd_rank"])
        result["floor"] = source.window_floor(MODEL.seq_len)
        for hook in STATEFUL:
            gathered: list[object] = [None] * WORLD
            dist.all_gather_object(gathered, resume_matches(hook, data, rank))
            result[f"{hook}_resume_by_rank"] = gathered
        if rank == 0:
            Path(out).write_text(json.dumps(result, indent=1))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(out: str, port: int) -> None:
    mp.spawn(worker, args=(out, port), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
