"""One rank of tests/dist/test_hf_placement.py: the model=hf builds each strategy asks for, on a real gloo group.

For every case the rank builds the model as its strategy's ``configure_model`` does (the factory with the
strategy's placement, then the plan: ZeRO-3 partitioning, FSDP2 sharding or the DDP wrap), gathers the full
parameters back and writes them, with what it observed (tensors it read from ``model.path``, whole-model loads,
elements it holds, the most elements one build step held unpartitioned), to ``rank<N>-<case>.pt``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from disttrain.config.schema import HFModelConfig, PrecisionConfig
from disttrain.config.strategy_schema import FSDPConfig
from disttrain.models import apply_activation_checkpointing
from disttrain.models.factory import build_model_factory
from disttrain.models.hf import SafetensorsWeights

ZERO3 = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
PLACEMENTS = {"zero3": "deferred", "fsdp": "deferred", "ddp": "rank0", "zero2": "rank0"}  # spec.py's, for 2 ranks


def _observe_reads() -> tuple[list[str], list[str]]:
    """Tensor names this process reads from safetensors files, and its whole-model ``from_pretrained`` loads."""
    from transformers import AutoModelForCausalLM

    reads: list[str] = []
    loads: list[str] = []
    get, from_pretrained = SafetensorsWeights.get, AutoModelForCausalLM.from_pretrained

    def counted_get(self: SafetensorsWeights, name: str, rows: list[int] | None = None) -> torch.Tensor:
        reads.append(name)
        return get(self, name, rows)

    def counted_from_pretrained(path: str, *args: Any, **kwargs: Any) -> nn.Module:
        loads.append(path)
        return from_pretrained(path, *args, **kwargs)

    SafetensorsWeights.get = counted_get  # type: ignore[method-assign]
    AutoModelForCausalLM.from_pretrained = counted_from_pretrained  # type: ignore[method-assign]
    return reads, loads


def _zero3(model: nn.Module) -> dict[str, Any]:
    import deepspeed

    from disttrain.strategies.deepspeed import partition_model

    peak = partition_model(model, ZERO3, None, torch.distributed.get_rank())
    unique = list({id(p): p for p in model.parameters()}.values())
    held = sum(p.ds_tensor.numel() for p in unique)
    whole_left = [n for n, p in model.named_parameters() if p.numel()]  # a partitioned parameter is empty
    with deepspeed.zero.GatheredParameters(unique):
        full = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"params": full, "peak": peak, "held": held, "whole_left": whole_left}


def _fsdp(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from disttrain.strategies.fsdp import apply_fsdp

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("data_parallel",))
    apply_fsdp(
        model, mesh, FSDPConfig(activation_checkpointing=True), PrecisionConfig(), apply_activation_checkpointing
    )
    held = sum(p.to_local().numel() for p in model.parameters())
    return {"params": {name: p.full_tensor() for name, p in model.named_parameters()}, "held": held}


def _ddp(model: nn.Module) -> dict[str, Any]:
    wrapped = nn.parallel.DistributedDataParallel(model)
    return {"params": {name: p.detach().clone() for name, p in wrapped.module.named_parameters()}}


def _zero2(model: nn.Module) -> dict[str, Any]:
    import argparse

    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.AdamW(model.parameters())
    args = argparse.Namespace(device_rank=torch.distributed.get_rank())  # as CPUCapableDeepSpeedStrategy passes
    engine, *_ = deepspeed.initialize(args=args, model=model, optimizer=optimizer, config=config)
    return {"params": {name: p.detach().clone() for name, p in engine.module.named_parameters()}}


def worker(rank: int, world: int, port: int, cases_json: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    import deepspeed

    from disttrain.strategies.deepspeed import disable_shm_comm_build

    disable_shm_comm_build()
    deepspeed.init_distributed(dist_backend="gloo")
    reads, loads = _observe_reads()
    for case, spec in json.loads(cases_json).items():
        del reads[:], loads[:]
        factory = build_model_factory(HFModelConfig(seq_len=32, **spec["model"]), 5, PLACEMENTS[spec["strategy"]])
        record = {"zero3": _zero3, "fsdp": _fsdp, "ddp": _ddp, "zero2": _zero2}[spec["strategy"]](factory())
        record.update(reads=list(reads), loads=list(loads))
        torch.save(record, Path(out) / f"rank{rank}-{case}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # Every result is written: skip the interpreter's teardown of deepspeed + transformers (seconds per rank).
    os._exit(0)
