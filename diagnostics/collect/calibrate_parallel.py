"""The calibrated per-layer overheads of tensor parallelism and FSDP: each probe times the same layers with and
without the parallel wrapping, in paired passes, so the planner can add what the wrapping costs this host per layer."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

from diagnostics.collect.calibrate import LayerClock, compute_clock, runqueue_seconds


def tp_linear_overhead(device: torch.device, tp: int, tokens: int = 8, width: int = 16, repeats: int = 8) -> dict:
    """Host seconds one tensor-parallel linear (DTensor ``ColwiseParallel``/``RowwiseParallel`` over groups of
    ``tp`` ranks) adds to a forward + backward beyond its share of the same ``nn.Linear``'s math: DTensor dispatch
    and sharding propagation, the wrapping of its functional collective, and the split GEMMs running below the whole
    ones' rate. A column-parallel then a row-parallel linear (Megatron's pair, ``width -> 2 width -> width``) over
    ``tokens`` tokens, the run's own shapes where it gives them, in alternation with the unsplit pair: the median of
    ``repeats`` paired differences against 1/tp of it on ``compute_clock`` (a rank's wait for a peer in the
    collective is not host work). The two functional all-reduces' own time on that clock is taken out: the planner
    prices the collectives themselves at their measured bandwidth (``functional_all_reduce``). The planner charges
    the rest per parallel linear of a layer (``hw.tp_linear_overhead_us``). Every rank must call it."""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def pair() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(width, 2 * width), nn.Linear(2 * width, width)).to(device)

    mesh = group_mesh(device, tp)
    plain = pair()
    parallel = parallelize_module(pair(), mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    x = torch.randn(1, tokens, width, device=device)
    start = time.perf_counter()
    pair_s = _paired_passes(plain, parallel, lambda m: m(x).sum(), device, repeats, share=1 / tp)
    collective = _functional_all_reduce_seconds(tokens * width, mesh.get_group(), device, repeats)
    overhead = pair_s["extra_s"] - 2 * collective
    return {
        "probe": "pair",
        "ranks": tp,
        "tokens": tokens,
        "width": width,
        "plain_pair_s": pair_s["plain_s"],
        "parallel_pair_s": pair_s["other_s"],
        "pair_extra_s": pair_s["extra_s"],
        "collective_s": collective,
        "overhead_us": max(0.0, overhead) / 2 * 1e6,
        "wall_s": time.perf_counter() - start,
    }


def tp_model_overhead(
    device: torch.device, tp: int, parts: Callable[[object], dict], micro_batch: int, repeats: int = 4
) -> dict:
    """Host seconds tensor parallelism adds to one forward + backward of the run's own layers beyond their share of
    the math (``tp_linear_overhead``'s measure, on the model itself): ``parts(tp_mesh)`` gives one transformer
    block and the model without blocks (embedding, final norm, LM head and the loss), plain and parallelized over
    groups of ``tp`` ranks (``disttrain.models.tensor_parallel.tp_probe_parts``; for an HF model a two-layer copy of
    it, plain and parallel, whose layers are timed inside its passes: ``hf_tp_probe_parts``), timed at ``micro_batch`` x
    seq_len tokens on ``compute_clock``, each in alternation with its plain twin (the median of ``repeats`` paired
    differences against 1/tp of it). The activation-sized functional all-reduces
    the planner prices itself (per block ``collectives``, two for the edges: the embedding's output and the head's
    input gradient) are taken out at their own measured time; what remains is per block (the planner charges it
    over the block's parallel linears, ``hw.tp_linear_overhead_us``) and once for the edges
    (``hw.tp_edge_overhead_us``): DTensor dispatch, the split GEMMs' lower rate, norms every TP rank repeats, the
    vocab-parallel lookup and loss. Every rank must call it."""
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = group_mesh(device, tp)
    start = time.perf_counter()
    p = parts(mesh)
    seq, d = p["seq_len"], p["d_model"]
    rope = p.get("rope") or (None, None)
    hidden = torch.randn(micro_batch, seq, d, device=device)
    tokens = torch.randint(0, p["vocab_size"], (micro_batch, seq), device=device)
    generator = torch.Generator(device="cpu").manual_seed(1)
    targets = torch.randint(0, p["vocab_size"], (micro_batch * seq,), generator=generator).to(device)

    def block_pass(model: torch.nn.Module) -> torch.Tensor:
        return model(hidden, *rope).sum()

    def edge_pass(model: torch.nn.Module) -> torch.Tensor:
        logits = model(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets)

    context = loss_parallel if p["loss_parallel"] else contextlib.nullcontext
    with context():
        if "model" in p:  # an HF model: its layers timed inside the whole model's passes
            block_s, edges_s = _paired_layer_passes(p["model"], p["layers"], edge_pass, device, repeats, share=1 / tp)
        else:
            (plain_block, parallel_block), (plain_edges, parallel_edges) = p["block"], p["edges"]
            block_s = _paired_passes(plain_block, parallel_block, block_pass, device, repeats, share=1 / tp)
            edges_s = _paired_passes(plain_edges, parallel_edges, edge_pass, device, repeats, share=1 / tp)
        tail = _step_tails(p, block_pass, edge_pass, device, repeats, share=1 / tp) if p.get("step_tail") else {}
    collective = _functional_all_reduce_seconds(micro_batch * seq * d, mesh.get_group(), device, repeats)
    block = block_s["extra_s"] - p["collectives_per_block"] * collective
    edges = edges_s["extra_s"] - 2 * collective
    return {
        "probe": "model",
        "ranks": tp,
        "tokens": micro_batch * seq,
        "width": d,
        "plain_block_s": block_s["plain_s"],
        "parallel_block_s": block_s["other_s"],
        "block_extra_s": block_s["extra_s"],
        "plain_edges_s": edges_s["plain_s"],
        "parallel_edges_s": edges_s["other_s"],
        "edges_extra_s": edges_s["extra_s"],
        # Wall time the parallel parts sat blocked in their collectives (the transfer, waits for the peer), which
        # the CPU clock leaves out. Recorded, not priced: as the TP collectives' cost it predicted no better than the
        # link model and scattered more (docs/planner.md, "TP collectives measured in situ").
        "parallel_block_blocked_s": block_s["other_blocked_s"],
        "parallel_edges_blocked_s": edges_s["other_blocked_s"],
        "collective_s": collective,
        "collectives_per_block": p["collectives_per_block"],
        "clock": compute_clock(device)[0],
        "modules_per_block": p["modules_per_block"],
        "overhead_us": max(0.0, block) / p["modules_per_block"] * 1e6,
        "edge_overhead_us": max(0.0, edges) * 1e6,
        **tail,
        "wall_s": time.perf_counter() - start,
    }


def _output_sum(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def group_mesh(device: torch.device, size: int) -> DeviceMesh:
    """A one-dimensional mesh over groups of ``size`` consecutive ranks (the run's TP or FSDP2 group shape); every
    rank must call it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return init_device_mesh(device.type, (world // size, size), mesh_dim_names=("replica", "group"))["group"]


def _functional_all_reduce_seconds(numel: int, group: object, device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` functional all-reduces of ``numel`` fp32 elements over ``group``, on
    ``compute_clock``: the share of a TP collective's time the probe's clock saw."""
    import torch.distributed._functional_collectives as functional

    _, clock = compute_clock(device)
    activation = torch.ones(numel, device=device)
    times = []
    for _ in range(repeats):
        begin = clock()
        functional.wait_tensor(functional.all_reduce(activation, "sum", group))
        times.append(clock() - begin)
    return min(times)


def _paired_passes(
    plain: torch.nn.Module,
    other: torch.nn.Module,
    loss: Callable[[torch.nn.Module], torch.Tensor],
    device: torch.device,
    repeats: int,
    share: float = 1.0,
) -> dict:
    """``loss(model).backward()`` of ``plain`` and ``other`` in alternation, ``repeats`` rounds after two warm-up
    rounds (which build DTensor's sharding-propagation caches and FSDP2's lazy state), on ``compute_clock``: the
    fastest of each, and ``extra_s``, the median over rounds of other - share x plain. Pairing within a round
    cancels the drift between rounds that separate best-ofs carried (a per-byte FSDP figure moved 3x between runs).
    ``other_blocked_s``: the median wall-clock time of ``other``'s pass beyond its ``compute_clock`` time and the time
    other processes held its core (``runqueue_seconds``), i.e. the time it sat blocked in collectives (waiting for
    its peers, the transfer) that a CPU clock does not see; 0 on a GPU, whose clock is the wall clock.
    """
    _, clock = compute_clock(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[int, list[float]] = {0: [], 1: []}
    blocked: list[float] = []
    for i in range(repeats + 2):
        for which, model in enumerate((plain, other)):
            sync()
            begin, wall, queued = clock(), time.perf_counter(), runqueue_seconds()
            loss(model).backward()
            sync()
            if i >= 2:
                times[which].append(clock() - begin)
                if which == 1:
                    preempted = runqueue_seconds() - queued
                    blocked.append(max(0.0, time.perf_counter() - wall - times[1][-1] - preempted))
            model.zero_grad(set_to_none=True)
    extra = statistics.median(o - share * p for p, o in zip(times[0], times[1], strict=True))
    return {
        "plain_s": min(times[0]),
        "other_s": min(times[1]),
        "extra_s": extra,
        "other_blocked_s": statistics.median(blocked),
    }


def _step_tails(
    p: dict,
    block_pass: Callable[[torch.nn.Module], torch.Tensor],
    model_pass: Callable[[torch.nn.Module], torch.Tensor],
    device: torch.device,
    repeats: int,
    share: float,
) -> dict:
    """The step's tail (``p["step_tail"]``: the gradients' norm, clipping, the run's AdamW) over one block's
    parameters, plain and tensor-parallel (DTensors: each op dispatched per tensor, the norm reduced over the
    group), each the median of ``repeats`` on ``compute_clock`` after one that allocates the moments, and the
    parallel one's extra over ``share`` of the plain one's (``hw.tp_step_overhead_us``). The gradients come from
    one pass of the block (of an HF model: of the whole model, its first layer's)."""
    _, clock = compute_clock(device)
    seconds = []
    for which in (0, 1):
        if "model" in p:
            model, block = p["model"][which], p["layers"][which][0]
            model_pass(model).backward()
        else:
            block = p["block"][which]
            block_pass(block).backward()
        tail = p["step_tail"](block)
        tail()
        times = []
        for _ in range(repeats):
            begin = clock()
            tail()
            times.append(clock() - begin)
        seconds.append(statistics.median(times))
    return {
        "plain_step_tail_s": seconds[0],
        "parallel_step_tail_s": seconds[1],
        "step_overhead_us": max(0.0, seconds[1] - share * seconds[0]) * 1e6,
    }


def _paired_layer_passes(
    models: tuple[torch.nn.Module, torch.nn.Module],
    layers: tuple[list[torch.nn.Module], list[torch.nn.Module]],
    loss: Callable[[torch.nn.Module], torch.Tensor],
    device: torch.device,
    repeats: int,
    share: float,
) -> tuple[dict, dict]:
    """``_paired_passes``'s figures for a block and for the edges of two whole models (plain, other) whose decoder
    ``layers`` hooks time inside each pass: a block is the layers' mean, the edges the rest of the pass. On the
    same clocks: ``compute_clock`` for the times, the wall clock less the run-queue wait for the blocked time."""
    _, clock = compute_clock(device)
    reads = (clock, time.perf_counter, runqueue_seconds)
    clocks = [[LayerClock(list(mine), read=read) for read in reads] for mine in layers]
    rounds: dict[int, list[tuple[float, float]]] = {0: [], 1: []}  # per pass: (block, edges) on compute_clock
    blocked: list[tuple[float, float]] = []
    try:
        for i in range(repeats + 2):  # two warm-up rounds, as _paired_passes
            for which, model in enumerate(models):
                for layer_clock in clocks[which]:
                    layer_clock.reset()
                begin = [read() for read in reads]
                loss(model).backward()
                whole = [read() - start for read, start in zip(reads, begin, strict=True)]
                model.zero_grad(set_to_none=True)
                if i < 2:
                    continue
                # (block, edges) on each clock: the layers' mean, and what the pass spent outside them
                parts = [
                    (statistics.mean(c.per_layer_s), total - sum(c.per_layer_s))
                    for c, total in zip(clocks[which], whole, strict=True)
                ]
                rounds[which].append(parts[0])
                if which == 1:
                    (cpu_b, cpu_e), (wall_b, wall_e), (queue_b, queue_e) = parts
                    blocked.append((max(0.0, wall_b - cpu_b - queue_b), max(0.0, wall_e - cpu_e - queue_e)))
    finally:
        for layer_clock in (c for mine in clocks for c in mine):
            layer_clock.remove()
    figures = []
    for part in (0, 1):
        plain, other = [r[part] for r in rounds[0]], [r[part] for r in rounds[1]]
        figures.append(
            {
                "plain_s": min(plain),
                "other_s": min(other),
                "extra_s": statistics.median(o - share * p for p, o in zip(plain, other, strict=True)),
                "other_blocked_s": statistics.median(b[part] for b in blocked),
            }
        )
    return figures[0], figures[1]


# Widths of the FSDP probe's unit (a Linear pair width -> 2 width -> width): the small one's copies are negligible
# (its overhead is the per-unit hooks), the large one's 4 MiB of fp32 parameters adds the copies' per-byte cost.
FSDP_PROBE_WIDTHS = (16, 512)


# FSDP2 copies a resharded unit's parameters out of its all-gather buffer in forward and again in backward, and its
# gradients into the reduce-scatter buffer: three copies of the unit's bytes per forward + backward.
FSDP_PROBE_COPIES = 3


def fsdp_unit_overhead(
    device: torch.device, shard_ranks: int, repeats: int = 6, widths: tuple[int, ...] = FSDP_PROBE_WIDTHS
) -> dict:
    """Host cost of FSDP2 (``fully_shard``) beyond a unit's math, over all ranks: per unit and forward + backward a
    fixed part (pre/post-forward and backward hooks, the collectives' wrapping) and a part per byte it copies
    (copy-in to and copy-out of the all-gather and reduce-scatter buffers). A unit resharded after forward under a
    parameterless root, sharded over groups of ``shard_ranks`` ranks (the run's FSDP2 degree: its collectives' host
    work depends on it), at two widths, against the same modules unwrapped, in alternation (the median of
    ``repeats`` paired differences on ``compute_clock``). ``fixed_us`` per FSDP module (the unit's and the root's
    hooks: half the small probe's overhead), ``ns_per_byte`` per byte of one copy (``hw.fsdp_unit_overhead_us``,
    ``hw.fsdp_copy_ns_per_byte``). ``widths`` without the large one: the fixed part alone (``fsdp_model_overhead``
    measures the per-byte part on the run's own model). Every rank must call it."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    mesh = group_mesh(device, shard_ranks)

    def unit(width: int) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Sequential(nn.Linear(width, 2 * width), nn.Linear(2 * width, width))).to(device)

    start = time.perf_counter()
    overhead: dict[int, float] = {}
    numel: dict[int, int] = {}
    for width in widths:
        plain, wrapped = unit(width), unit(width)
        fully_shard(wrapped[0], mesh=mesh, reshard_after_forward=True)
        fully_shard(wrapped, mesh=mesh)
        x = torch.randn(8, width, device=device)  # 2-D: a 3-D input makes Linear return a view, which FSDP2 warns of
        passes = _paired_passes(plain, wrapped, partial(_output_sum, x=x), device, repeats)
        overhead[width] = max(0.0, passes["extra_s"])
        numel[width] = sum(p.numel() for p in plain.parameters())
    small, large = FSDP_PROBE_WIDTHS
    record = {
        "ranks": shard_ranks,
        "overhead_s": {str(width): seconds for width, seconds in overhead.items()},
        "unit_numel": {str(width): n for width, n in numel.items()},
        "fixed_us": overhead[small] / 2 * 1e6,
    }
    if large in overhead:
        element = torch.empty((), dtype=torch.float32).element_size()
        copied = FSDP_PROBE_COPIES * (numel[large] - numel[small]) * element
        record["ns_per_byte"] = max(0.0, overhead[large] - overhead[small]) / copied * 1e9
    return {**record, "wall_s": time.perf_counter() - start}


def fsdp_model_overhead(
    device: torch.device,
    shard_ranks: int,
    parts: Callable[[DeviceMesh], dict],
    micro_batch: int,
    fixed_us: float,
    repeats: int = 6,
) -> dict:
    """FSDP2's host cost on the run's own model: ``parts(mesh)`` gives a small copy of it (a block or two and its
    edges: ``disttrain.strategies.fsdp_probe``), plain and sharded over groups of ``shard_ranks`` ranks as the run
    shards it, the FSDP2 ``modules`` it has and the ``copy_bytes`` its units copy per forward + backward. Both are
    timed at ``micro_batch`` x seq_len tokens through the loss, in alternation on ``compute_clock`` (the median of
    ``repeats`` paired differences). Less ``fixed_us`` per module (the hooks, from ``fsdp_unit_overhead``), what
    remains is charged per byte copied (``ns_per_byte``, ``hw.fsdp_copy_ns_per_byte``): on the run's block it comes
    out 3-4x what a Linear pair of the same bytes shows. The time the sharded pass sat blocked in its collectives is
    recorded beside it, not priced (the link model prices the collectives). Every rank must call it."""
    import torch.nn.functional as F

    start = time.perf_counter()
    mesh = group_mesh(device, shard_ranks)
    p = parts(mesh)
    tokens = torch.randint(0, p["vocab_size"], (micro_batch, p["seq_len"]), device=device)
    targets = tokens.roll(-1, dims=1).reshape(-1)

    def loss(model: torch.nn.Module) -> torch.Tensor:
        logits = model(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets)

    passes = _paired_passes(p["plain"], p["sharded"], loss, device, repeats)
    net = passes["extra_s"] - p["modules"] * fixed_us * 1e-6
    return {
        "probe": "model",
        "tokens": micro_batch * p["seq_len"],
        "modules": p["modules"],
        "copy_bytes": p["copy_bytes"],
        "plain_model_s": passes["plain_s"],
        "sharded_model_s": passes["other_s"],
        "model_extra_s": passes["extra_s"],
        "sharded_blocked_s": passes["other_blocked_s"],
        "ns_per_byte": max(0.0, net) / p["copy_bytes"] * 1e9,
        "model_wall_s": time.perf_counter() - start,
    }
