"""The LightningModule: next-token loss, AdamW with warmup + cosine, and the per-token FLOPs of the model.

The model is built in ``configure_model`` (not ``__init__``) so strategies that shard it (FSDP2) can apply
their plan before the optimizer sees the parameters, and so huge models are never materialised whole.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from disttrain.config.schema import OptimizerConfig
from disttrain.models.moe import auxiliary_loss, moe_layers
from disttrain.models.onebit_adam import MomentumExchange, OneBitAdam

ModelFactory = Callable[[], nn.Module]
# Applies a strategy's parallel plan in place; receives the DeviceMesh when the strategy has one.
Parallelize = Callable[[nn.Module, object], None]


def lr_lambda(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier on the peak lr: linear warmup from ~0, then cosine down to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits [B, T, V]`` against ``targets [B, T]``, computed in fp32 whatever the compute
    dtype (a bf16 log-softmax over a large vocabulary loses bits)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


@functools.cache
def compiled_next_token_loss() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``next_token_loss`` compiled: the fp32 upcast, log-softmax and loss fuse into a few kernels instead of
    materializing an fp32 copy of the logits (gpt2-124m at 16 x 1024 tokens: 3.3 GB written and read again in
    backward). Built on first use: ``torch.compile`` imports dynamo (~1.4 s), which runs without compile skip."""
    return torch.compile(next_token_loss)


def use_fused_adamw(params: list[torch.Tensor], fused: bool | None) -> bool:
    """torch's fused AdamW (one kernel launch for all parameters) where asked; by default where every parameter
    lives on a GPU (it has no CPU kernel worth having, and offloaded parameters step on the host)."""
    if fused is not None:
        return fused
    return bool(params) and all(p.device.type == "cuda" and p.is_floating_point() for p in params)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (ndim >= 2) decay; biases and norm weights do not (they have no scale to regularise)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():
        if param.requires_grad:
            # A ZeRO-3 partitioned parameter is an empty placeholder; ``ds_shape`` is its real shape.
            ndim = len(getattr(param, "ds_shape", param.shape))
            (decay if ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class LanguageModelModule(pl.LightningModule):
    def __init__(
        self,
        model_factory: ModelFactory | None,
        optimizer: OptimizerConfig,
        max_steps: int,
        parallelize: Parallelize | None = None,
        flops_per_token: float | None = None,
        log_every_n_steps: int = 1,
        accumulation: int = 1,
        compile_loss: bool = False,
        cudagraphs: bool = False,
        onebit: MomentumExchange | None = None,
    ) -> None:
        super().__init__()
        self.model_factory = model_factory
        self.optimizer_cfg = optimizer
        self.max_steps = max_steps
        self.parallelize = parallelize
        self.flops_per_token = flops_per_token
        self.log_every_n_steps = log_every_n_steps
        self.accumulation = accumulation
        self.compile_loss = compile_loss
        # Blocks compiled into CUDA graphs (model.compile_mode=reduce-overhead) reuse their output memory on every
        # replay: each forward starts a new generation, so validation's no-grad graphs never read outputs that a
        # later replay has overwritten.
        self.cudagraphs = cudagraphs
        self.onebit = onebit  # optimizer=onebit_adam: shared with DDP's hook and the checkpoint (strategies/onebit.py)
        self._micro_losses: list[torch.Tensor] = []
        self.model: nn.Module | None = None
        self._moe_layers: list = []  # a mixture-of-experts model's MoE layers (their auxiliary losses)

    def configure_model(self) -> None:
        # Lightning may call this more than once (fit, then validate): build and shard only once.
        if self.model is not None:
            return
        assert self.model_factory is not None, "a subclass without a factory builds its model itself"
        self.model = self.model_factory()
        if self.parallelize is not None:
            mesh = getattr(self, "_device_mesh", None)
            self.parallelize(self.model, mesh)
        self._moe_layers = moe_layers(self.model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self.model is not None, "configure_model() builds the model"
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return self.model(tokens)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        logits = self(inputs)
        return (compiled_next_token_loss() if self.compile_loss else next_token_loss)(logits, targets)

    def is_logging_step(self) -> bool:
        """Steps whose metrics the logger writes (Lightning's rule), plus the final one for the summary."""
        step = self.global_step + 1
        return step % self.log_every_n_steps == 0 or step >= self.max_steps

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        if self.is_logging_step():
            self._micro_losses.append(loss.detach())
        return self.with_auxiliary_loss(loss)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """A logged step's loss: the mean over its accumulated micro-batches and over the data-parallel ranks (the
        global-batch loss), only on logged steps (an all-reduce every step costs small models throughput).

        Averaged here, after backward's gradient reduction has brought the ranks together, not in training_step:
        an all-reduce inside forward makes a rank that waits there for a late peer look slow in forward itself,
        which hides the late rank from the diagnostics' order of arrival (a rank stalling on logged steps went
        unreported: benchmarks/RESULTS.md, "Figures moved from the code")."""
        # DeepSpeed's engine accumulates itself: Lightning then calls this hook after every micro-batch.
        if len(self._micro_losses) == self.accumulation:
            step_loss = torch.stack(self._micro_losses).mean()
            self._micro_losses = []
            self.log("train/loss", step_loss, on_step=True, on_epoch=False, sync_dist=True)

    def with_auxiliary_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The objective: the LM loss (what ``train/loss`` reports) plus an MoE model's balancing and z-losses."""
        if not self._moe_layers:
            return loss
        aux = auxiliary_loss(self._moe_layers)
        return loss if aux is None else loss + aux.to(loss.dtype)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.loss(batch), on_step=False, on_epoch=True, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> dict:
        assert self.model is not None
        o = self.optimizer_cfg
        groups = param_groups(self.model, o.weight_decay)
        optimizer: torch.optim.Optimizer
        if o.name == "onebit_adam":
            if self.onebit is None:
                raise ValueError("optimizer=onebit_adam needs its exchange (DDP's spec builds it)")
            optimizer = OneBitAdam(groups, self.onebit, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        else:
            fused = use_fused_adamw([p for g in groups for p in g["params"]], o.fused)
            optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused or None)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_lambda(step, o.warmup_steps, self.max_steps, o.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
