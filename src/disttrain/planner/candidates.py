"""Every layout worth predicting for a world size: the strategies we run and the ones we model for comparison.

Rules (each a hard constraint of the strategy, not a taste):

- The global batch is held fixed, so a layout needs ``global % (micro x dp) == 0``; its micro-batches per step
  (accumulation, or pipeline micro-batches) are ``global / (micro x dp)``.
- DDP, FSDP2 full shard, FSDP2 hybrid (shard within a node, replicate across nodes; only when there are
  nodes to replicate over), ZeRO-1/2/3 with optimizer offload and, for stage 3, parameter offload.
  Offload needs GPUs; FSDP2 here supports fp32/bf16 only (``disttrain.config.validate``).
- Megatron TP x PP x DP: tp divides the GPUs of a node (TP traffic must stay on NVLink) and both the head and
  kv-head counts; pp divides the layers; sequence parallelism is on whenever tp > 1 (it only removes
  redundant activations at the same communication volume) unless the caller asks for TP without it.
  Interleaving needs layers divisible by pp x v and micro-batches divisible by pp (Megatron's check); the
  zero-bubble V schedule needs two chunks per rank and at least pp micro-batches.
- Recomputation: FSDP2 and DeepSpeed offer full activation checkpointing; Megatron none/selective/full.
- Expert parallelism (an MoE model): FSDP2 full shard with every ``ep > 1`` dividing both the experts and the
  world (``strategy.ep``'s own rule); not with HSDP.
"""

from __future__ import annotations

from collections.abc import Iterator

from disttrain.config.hardware import HardwareProfile
from disttrain.planner.expert_shapes import expert_parallel_degrees
from disttrain.planner.shapes import ModelShape
from disttrain.planner.spec import Layout, Workload

INTERLEAVED_VIRTUAL_STAGES = (2, 4)
ZERO_BUBBLE_VIRTUAL_STAGES = 2  # the V schedule: two model chunks per rank
MEGATRON_RECOMPUTE = ("none", "selective", "full")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def microbatches_for(workload: Workload, dp: int) -> int | None:
    """Micro-batches per step per data-parallel rank, or None when the global batch does not split evenly."""
    per_round = workload.micro_batch_size * dp
    if workload.global_batch_size % per_round:
        return None
    return workload.global_batch_size // per_round


def _data_parallel(shape: ModelShape, hw: HardwareProfile, workload: Workload, fsdp_ok: bool) -> Iterator[Layout]:
    world, on_gpu = hw.world_size, hw.accelerator == "gpu"
    # Recomputation only trades activations, which a raw parameter count does not have.
    recomputes = ("none", "full") if shape.known else ("none",)
    m = microbatches_for(workload, world)
    if m is None:
        return
    yield Layout("ddp", dp=world, microbatches=m)
    offloads = (False, True) if on_gpu else (False,)
    replicas = [1] + ([hw.num_nodes] if hw.num_nodes > 1 else [])
    # Expert parallelism composes with full sharding only (strategy.ep refuses HSDP).
    shardings = [(replicate, 1) for replicate in replicas] + [(1, ep) for ep in expert_parallel_degrees(shape, world)]
    for replicate, ep in shardings if fsdp_ok else ():
        for reshard in (True, False):
            for recompute in recomputes:
                for offload in offloads:
                    yield Layout(
                        "fsdp",
                        dp=world,
                        microbatches=m,
                        dp_replicate=replicate,
                        reshard_after_forward=reshard,
                        recompute=recompute,
                        offload_optimizer=offload,
                        ep=ep,
                    )
    zero_offloads = {1: [(False, False)], 2: [(False, False)], 3: [(False, False)]}
    if on_gpu:
        zero_offloads = {1: [(False, False), (True, False)], 2: [(False, False), (True, False)]}
        zero_offloads[3] = [(False, False), (True, False), (True, True)]
    for stage, offload_pairs in zero_offloads.items():
        for offload_optimizer, offload_params in offload_pairs:
            for recompute in recomputes:
                yield Layout(
                    "deepspeed",
                    dp=world,
                    microbatches=m,
                    zero_stage=stage,
                    offload_optimizer=offload_optimizer,
                    offload_params=offload_params,
                    recompute=recompute,
                )


def _schedules(shape: ModelShape, pp: int, m: int) -> Iterator[tuple[str, int]]:
    if pp == 1:
        yield "none", 1
        return
    yield "gpipe", 1
    yield "1f1b", 1
    for v in INTERLEAVED_VIRTUAL_STAGES:
        if shape.n_layers % (pp * v) == 0 and m % pp == 0:
            yield "interleaved_1f1b", v
    if shape.n_layers % (pp * ZERO_BUBBLE_VIRTUAL_STAGES) == 0 and m >= pp:
        yield "zero_bubble", ZERO_BUBBLE_VIRTUAL_STAGES


def tensor_parallel_degrees(shape: ModelShape, hw: HardwareProfile) -> list[int]:
    """TP degrees that stay within a node and divide the attention heads and kv heads (and the routed experts)."""
    return [
        tp
        for tp in divisors(hw.devices_per_node)
        if hw.world_size % tp == 0
        and shape.n_heads % tp == 0
        and shape.kv_heads % tp == 0
        and (not shape.num_experts or shape.num_experts % tp == 0)
    ]


def megatron_layouts(
    shape: ModelShape, hw: HardwareProfile, workload: Workload, sequence_parallel: bool | None = True
) -> Iterator[Layout]:
    """Megatron TP x PP x DP layouts (also what ``strategy=auto`` chooses from).

    ``sequence_parallel``: with tp > 1, True plans TP with sequence parallelism, False TP alone, None both.
    """
    sp_options = (True, False) if sequence_parallel is None else (sequence_parallel,)
    if not shape.known:  # no layers to split: a raw parameter count answers model-state questions only
        return
    if shape.num_experts:
        # The tp ranks split the built-in model's experts, without sequence parallelism; transformers' MoE blocks
        # have no TP plan (config/experts.validate_megatron_experts).
        if not shape.megatron_experts:
            return
        sp_options = (False,)
    world = hw.world_size
    for tp in tensor_parallel_degrees(shape, hw):
        for pp in divisors(world // tp):
            if shape.n_layers % pp:
                continue
            dp = world // (tp * pp)
            m = microbatches_for(workload, dp)
            if m is None:
                continue
            for schedule, v in _schedules(shape, pp, m):
                for sp in sp_options if tp > 1 else (False,):
                    for recompute in MEGATRON_RECOMPUTE:
                        yield Layout(
                            "megatron",
                            dp=dp,
                            tp=tp,
                            pp=pp,
                            microbatches=m,
                            recompute=recompute,
                            sequence_parallel=sp,
                            schedule=schedule,
                            virtual_stages=v,
                        )


def candidate_layouts(
    shape: ModelShape, hw: HardwareProfile, workload: Workload, sequence_parallel: bool | None = True
) -> list[Layout]:
    """All layouts for ``hw``'s world that the rules above allow, in a stable order."""
    fsdp_ok = workload.precision != "fp16-mixed"
    megatron = megatron_layouts(shape, hw, workload, sequence_parallel)
    return [*_data_parallel(shape, hw, workload, fsdp_ok), *megatron]
