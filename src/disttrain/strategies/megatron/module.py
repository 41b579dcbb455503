"""The LightningModule of ``strategy=megatron``: manual optimization around the engine's pipeline step.

A pipeline schedule runs forward and backward of all micro-batches itself, so Lightning's automatic
optimization (one closure per micro-batch) cannot drive it; this module runs one optimizer step per batch:
zero grads, the engine's forward/backward, tied-embedding sync, global-norm clipping, step, schedule.
"""

from __future__ import annotations

import torch
from torch import nn

from disttrain.config.schema import OptimizerConfig
from disttrain.models.module import LanguageModelModule
from disttrain.strategies.megatron.engine import EngineSettings, MegatronEngine, StepTiming


class StageUnion(nn.Module):
    """This rank's chunks seen as one model under the whole model's parameter names.

    Checkpoints and the optimizer see ``blocks.<layer id>.*``, ``tok_emb.*``, ``lm_head.*`` exactly as a single
    process names them, so a checkpoint's index is the same whatever the layout (the resume checks compare it
    with the configured model, and torch.distributed.checkpoint can reshard it onto another layout).
    """

    def __init__(self, chunks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict()
        for chunk in chunks:
            for key, block in chunk.blocks.items():
                self.blocks[key] = block
            for name in ("tok_emb", "pos_emb", "norm", "lm_head"):
                part = getattr(chunk, name)
                if part is not None:
                    setattr(self, name, part)


class MegatronModule(LanguageModelModule):
    def __init__(
        self,
        settings: EngineSettings,
        optimizer: OptimizerConfig,
        max_steps: int,
        grad_clip: float,
        flops_per_token: float | None = None,
        log_every_n_steps: int = 1,
    ) -> None:
        super().__init__(
            None, optimizer, max_steps, flops_per_token=flops_per_token, log_every_n_steps=log_every_n_steps
        )
        self.automatic_optimization = False
        self.settings = settings
        self.grad_clip = grad_clip
        self.engine: MegatronEngine | None = None
        self._schedule_timing: StepTiming | None = None

    def configure_model(self) -> None:
        if self.engine is not None:
            return
        mesh = getattr(self, "_device_mesh", None)
        assert mesh is not None, "MegatronStrategy sets the device mesh before configure_model"
        self.engine = MegatronEngine(self.settings, mesh, self.trainer.strategy.root_device)
        # An HF model (or its one pipeline stage here) keeps its own names, as under every other strategy: the HF
        # export reads them, and the stages' names together are the whole model's.
        self.model = self.engine.chunks[0] if self.engine.hf else StageUnion(self.engine.chunks)

    @property
    def tied_twins(self) -> dict[str, str]:
        """A last pipeline stage's own copy of the tied LM head, and the parameter one process holds it as."""
        tied = getattr(self.settings.model, "tie_embeddings", False)
        return {"model.lm_head.weight": "model.tok_emb.weight"} if tied else {}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("strategy=megatron runs its chunks through the pipeline engine, not forward()")

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.engine is not None
        optimizer, schedule = self.optimizers(), self.lr_schedulers()
        logging = self.is_logging_step()  # before the step: optimizer.step() advances global_step
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = batch
        # Plain backward, not manual_backward: Lightning's backward hooks would time one micro-batch as the
        # whole step; the engine times its own phases, which the diagnostics read (pop_schedule_timing).
        loss = self.engine.forward_backward(inputs, targets, torch.Tensor.backward)
        self._schedule_timing = self.engine.last_timing
        if self.grad_clip:
            self.engine.clip_grad_norm_(self.grad_clip)
        optimizer.step()
        schedule.step()  # type: ignore[union-attr]
        if logging:
            self.log("train/loss", loss, on_step=True, on_epoch=False, sync_dist=True)
        return loss

    def pop_schedule_timing(self) -> StepTiming | None:
        """The last training step's forward/backward/wall time inside the engine, once (None when already read).

        The diagnostics collector reads it at the step's end: the schedule runs its micro-batches outside
        Lightning's backward hooks, so the collector cannot time them itself."""
        timing, self._schedule_timing = self._schedule_timing, None
        return timing

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        assert self.engine is not None
        inputs, targets = batch
        self.log("val/loss", self.engine.evaluate(inputs, targets), on_step=False, on_epoch=True, sync_dist=True)
