"""What the diagnostics callback is told about the run, typed, by the pipeline: how often to collect
(``CollectSettings``) and the run's facts its collectors and probes need (``RunFacts``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CollectSettings:
    step_every: int = 1
    gather_every: int = 10
    sample_interval_s: float = 2.0
    profile: bool = True
    profile_wait_steps: int = 10
    profile_active_steps: int = 3
    calibrate: bool = True
    hang_timeout_s: float = 600.0


@dataclass(frozen=True)
class RunFacts:
    """What the collectors need to know about the run (typed, from the pipeline)."""

    strategy: str
    precision: str
    compute_dtype: str
    hw: str
    num_parameters: int
    # The run's unit of work: "token" for a token model; "sample" for a LightningModule, whose samples are its
    # batches' rows. ``flops_per_token``, ``tokens_per_step`` and the telemetry's ``tokens_per_s`` are per unit of
    # work (the names predate other units; a sample run's telemetry says ``work_unit: sample``).
    flops_per_token: float
    hardware_flops_per_token: float
    tokens_per_step: int
    micro_batch_size: int
    accumulation: int
    seq_len: int
    max_steps: int
    peak_flops: float | None  # datasheet dense peak per device for compute_dtype, None if unknown
    tp: int = 1  # tensor-parallel degree (strategy=megatron): the DTensor dispatch probe runs only when above 1
    d_model: int = 0  # the model's width where the planner knows its shape: the TP probe runs at the run's shapes
    # The run's own layers, plain and tensor-parallel, for the TP probe (``parts(tp_mesh, device=...)``, see
    # ``tp_model_overhead``): the reference transformer's; None (a user or HF model): a linear pair stands in.
    tp_probe: Callable[..., dict] | None = None
    # Ranks each FSDP2 unit shards over (strategy=fsdp; strategy=megatron's data parallelism, which wraps its chunks
    # even over one rank); 0: no FSDP2. The FSDP host-cost probe runs over groups of that size, only then.
    fsdp_shard_ranks: int = 0
    # A small copy of the run's own model, plain and sharded as the run shards it, for the FSDP probe's per-byte
    # cost (``parts(mesh, device=...)``, see ``fsdp_model_overhead``); None: a Linear pair stands in.
    fsdp_probe: Callable[..., dict] | None = None
    # Collectives issued off the training and autograd threads (DDP's PowerSGD hook, from gloo's future callbacks):
    # only then does the profiler window profile every thread.
    collectives_off_thread: bool = False
    # The run's own block, edges and block optimizer for the parts probe (``parts(device)``, see
    # ``diagnostics.collect.parts``): the reference transformer's; None (a user or HF model): not probed.
    parts_probe: Callable[[torch.device], dict] | None = None
    # The run's step tail over a module's gradients (``step_tail(module)()``: the non-finite guard's norm, clipping
    # with it, the run's AdamW), for the FSDP probe's sharded-parameter cost; None: that part is not probed.
    step_tail: Callable[[torch.nn.Module], Callable[[], None]] | None = None
    # A small copy of the run's own model and its DeepSpeed engine for the ZeRO probe (``parts(device=...)``, see
    # ``zero_overhead``): a strategy=deepspeed run at ZeRO-1/2 the probe can build; None: not probed.
    zero_probe: Callable[..., dict] | None = None
    work_unit: str = "token"
    # A user's LightningModule timed whole on a copy at the run's real micro-batch (``module_probe(module, batch,
    # trainer)`` gives the parts ``diagnostics.collect.parts.time_module_parts`` times, or None where it cannot be
    # probed); None: not probed (the built-in models have ``parts_probe``; sharded strategies shard the module).
    module_probe: Callable[..., dict | None] | None = None
    tokens_per_sample: int | None = None  # a sample run whose module says what a token is (its tokens per sample)
    # FLOPs per unit counted at the first step (training/flop_count.py) where the module states none: the MFU
    # numerator from then on (``flops_per_token`` is 0 until then).
    counted_flops_per_unit: Callable[[], float | None] | None = None
