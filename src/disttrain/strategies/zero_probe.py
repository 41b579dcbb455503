"""The ZeRO probe's parts for a strategy=deepspeed run at stage 1 or 2 (``diagnostics.collect.zero_step``): a small copy
of the run's own model (a block and its edges; an HF model at two layers), a DeepSpeed engine over any module with
the run's ZeRO settings and AdamW (the plain twin's step is the run's step tail: ``training.step_tail``).

What ZeRO-1/2 adds on the host beyond the math and the collectives the link model prices: a Python hook per
parameter that copies its gradient into the reduction bucket, then in the step the overflow check, the norm, the
gradients flattened into the partition, clipping, AdamW over the partition and the copy back into the parameters'
flat buffer. On 2 CPU ranks of gpt-micro and the default model its optimizer phase measured 12-13 ms beyond its
collectives against 2-4 ms planned, and its backward 4-10 ms over DDP's (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any, TypeGuard

import torch
from torch import nn

from disttrain.config.schema import HFModelConfig, ModelConfig, OptimizerConfig, PrecisionConfig
from disttrain.config.strategy_schema import DeepSpeedConfig
from disttrain.models.probe_parts import block_optimizer, dense_known_model, small_model_copy
from disttrain.planner.terms.deepspeed import ZERO_HOST_STAGES
from disttrain.strategies.deepspeed import deepspeed_config


def zero_probe_supported(
    model: object, ds: DeepSpeedConfig, precision: PrecisionConfig, compiled: bool
) -> TypeGuard[ModelConfig | HFModelConfig]:
    """Whether the probe can build the run's engine on a copy of its model: ZeRO-1/2 without offload, in fp32
    (DeepSpeed's bf16/fp16 engines keep an fp32 master the plain twin would not have), the reference transformer or
    an HF model, dense and uncompiled."""
    return (
        dense_known_model(model)
        and not compiled
        and ds.stage in ZERO_HOST_STAGES  # the stages the planner charges these figures to
        and ds.optimizer_offload_device is None
        and ds.param_offload_device is None
        and not ds.activation_checkpointing
        and precision.name == "fp32"
    )


def zero_probe_parts(
    model: ModelConfig | HFModelConfig,
    ds: DeepSpeedConfig,
    optimizer: OptimizerConfig,
    grad_clip: float | None,
    micro_batch: int,
    accumulation: int,
    device: torch.device,
) -> dict[str, object]:
    """``model`` (a small copy of the run's, tokens -> logits, fp32), ``engine(module)`` (DeepSpeed over ``module``
    with the run's ZeRO settings, clipping, AdamW and gradient accumulation: each micro-batch is
    ``engine.backward(loss)`` then ``engine.step()``, which steps at the last), ``accumulation``, ``vocab_size`` and
    ``seq_len``."""
    small = small_model_copy(model, torch.float32, device)
    # What Lightning adds to the run's config: clipping, and accumulation (ZeRO-2 then reduces every micro-batch and
    # adds each into its partition, work a single micro-batch per step would not show).
    config = {
        **deepspeed_config(ds, micro_batch),
        "gradient_clipping": float(grad_clip or 0.0),
        "gradient_accumulation_steps": accumulation,
    }

    def engine(module: nn.Module) -> Any:
        import deepspeed

        wrapped, *_ = deepspeed.initialize(
            # As the run's engine (strategies/deepspeed.py): DeepSpeed wants the local rank, set by every launcher.
            args=argparse.Namespace(device_rank=int(os.environ.get("LOCAL_RANK", 0))),
            config=copy.deepcopy(config),
            model=module,
            model_parameters=[p for p in module.parameters() if p.requires_grad],
            optimizer=block_optimizer(module, optimizer),
            dist_init_required=False,
        )
        return wrapped

    return {
        "model": small,
        "engine": engine,
        "accumulation": accumulation,
        "vocab_size": model.vocab_size,
        "seq_len": model.seq_len,
    }
