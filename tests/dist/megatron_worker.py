"""Runs several Megatron layouts in one gloo process group and records per-step losses and local shard sizes.

Spawned by tests/dist/test_megatron.py (``torch.multiprocessing``); every layout trains the same tiny model on
the same global batches as the single-process reference in the test.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from disttrain.config.degrees import megatron_degrees
from disttrain.config.schema import ModelConfig
from disttrain.config.strategy_schema import MegatronConfig
from disttrain.launch.process_exit import finish_and_exit
from disttrain.models.module import param_groups
from disttrain.strategies.megatron.engine import EngineSettings, MegatronEngine, build_mesh

STEPS = 6
LR = 1e-2
CLIP = 1.0
GLOBAL_BATCH = 8


def global_batches(model: ModelConfig, steps: int = STEPS, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable sequences (each row counts up by a stride of 1-3 from a random start), so the loss falls fast
    and a wrong gradient anywhere shows in the losses within a few steps."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(model.seq_len + 1)
    batches = []
    for _ in range(steps):
        start = torch.randint(0, model.vocab_size, (GLOBAL_BATCH, 1), generator=gen)
        stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=gen)
        tokens = (start + stride * positions) % model.vocab_size
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


def eval_batch(model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch no step trained on, evaluated after the last step (forward only, through every stage)."""
    return global_batches(model, steps=1, seed=99)[0]


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, 0.1), lr=LR, betas=(0.9, 0.95), eps=1e-8)


def run_layout(model: ModelConfig, strategy: MegatronConfig, world: int, rounds: int = 1) -> dict:
    degrees = megatron_degrees(strategy, world)
    mesh = build_mesh(degrees, "cpu")
    engine = MegatronEngine(
        EngineSettings(model, strategy, degrees, None, seed=11, rounds=rounds), mesh, torch.device("cpu")
    )
    container = torch.nn.ModuleList(engine.chunks)
    optimizer = optimizer_for(container)
    dp_rank, dp = degrees.coordinates(dist.get_rank())["dp"], degrees.dp
    losses, norms = [], []
    for inputs, targets in global_batches(model):
        rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
        optimizer.zero_grad(set_to_none=True)
        loss = engine.forward_backward(inputs[rows], targets[rows], lambda loss: loss.backward())
        norms.append(engine.clip_grad_norm_(CLIP).item())
        optimizer.step()
        # Every rank holds its data-parallel group's mean: the world mean is the global-batch loss.
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    # Counted before evaluating: a forward without backward leaves FSDP2's root unit gathered (not resharded).
    held = local_numel(container)
    inputs, targets = eval_batch(model)
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    eval_loss = engine.evaluate(inputs[rows], targets[rows])
    dist.all_reduce(eval_loss)
    return {
        "losses": losses,
        "norms": norms,
        "eval_loss": eval_loss.item() / world,
        "local_numel": held,
        "stages": engine.stage_ids,
        "coords": degrees.coordinates(dist.get_rank()),
    }


def local_numel(model: torch.nn.Module) -> int:
    """Elements this rank holds (a DTensor shard by its local size; a tied weight once)."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)


def worker(rank: int, world: int, port: int, model_json: str, layouts_json: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = ModelConfig(**json.loads(model_json))
        results = {}
        for name, options in json.loads(layouts_json).items():
            rounds = options.pop("rounds", 1)
            results[name] = run_layout(model, replace(MegatronConfig(), **options), world, rounds)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier()
    finally:
        # No barrier on the way out of a failure: the other ranks may be blocked in a collective with this one, and
        # the spawner ends them once it sees this rank fail.
        dist.destroy_process_group()
    # Every result is written: end without the interpreter's teardown of C++ objects, which aborts now and then
    # around the gloo threads DTensor's meshes keep alive ("terminate called without an active exception", seen
    # once in CI; src/disttrain/launch/process_exit.py). A failure above still reaches mp.spawn as an exception.
    finish_and_exit(0)
