"""One interface per strategy: what the rest of the pipeline asks of DDP, FSDP2, DeepSpeed or Megatron.

Validation, the data-parallel size and schedule, the planner's layout, the loader's batch size, whether blocks are
recomputed, and the Lightning objects all come from the strategy's ``StrategySpec``: one module each
(``<name>_spec.py``), found from its config class in ``registry.py``. The planner's memory, communication and
step-time terms of the layout a spec returns are the strategy's ``StrategyTerms`` (``planner/terms/<name>.py``, one
layer below; docs/extension.md lists every file a new strategy touches). The specs cost no torch: ``prepare()`` and
``python -m plan`` use them before anything is spawned, and the builders import their strategy's module lazily.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from disttrain.config.schema import CUDAGRAPH_MODES, LightningModuleConfig, RunConfig
from disttrain.planner import Layout

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from disttrain.models.facts import ModelFacts


@dataclass(frozen=True)
class StrategyBuild:
    strategy: Any  # the Lightning Strategy
    parallelize: Callable[[Any, object], None] | None  # (model, device_mesh), in LightningModule.configure_model
    trainer_precision: str  # what the Lightning Trainer is given as `precision`
    # optimizer=onebit_adam: what DDP's hook, the optimizer and the checkpoint share (strategies/onebit.py)
    onebit: Any = None


def process_group_backend(accelerator: str) -> str:
    return "nccl" if accelerator == "gpu" else "gloo"


class StrategySpec:
    """The defaults are data parallelism over every process with Lightning's automatic optimization."""

    name: ClassVar[str]
    # The strategy's own engine runs forward/backward/step over a whole step's micro-batches (manual optimization):
    # the loader hands it one step per batch and the module clips gradients itself.
    engine_runs_the_step: ClassVar[bool] = False
    # FSDP and DeepSpeed change the model and optimizer even in one process: use them whenever asked for.
    wraps_one_process: ClassVar[bool] = True
    # Gradients are clipped by torch's clip_grad_norm_ over the optimizer's parameters (Lightning's own path), so the
    # non-finite check, which computes the same global norm, clips with it (one pass over the gradients, not two).
    norm_clipped_by_torch: ClassVar[bool] = True
    # optimizer.fused=null may pick torch's fused AdamW (models/module.py: where every parameter is on a GPU).
    fused_optimizer_ok: ClassVar[bool] = True
    # Every rank holds the whole module as plain tensors: a copy of it runs with no collective of the strategy's
    # (the module probe, training/module_probe.py). Sharding strategies hold a shard.
    ranks_hold_the_whole_module: ClassVar[bool] = False

    def __init__(self, config: Any) -> None:
        self.config = config

    def data_parallel_size(self, world_size: int) -> int:
        return world_size

    @property
    def schedule_microbatches(self) -> int:
        """Micro-batches one pass of the strategy's schedule takes per data-parallel rank."""
        return 1

    def validate(self, cfg: RunConfig) -> None:
        """Refuse settings that cannot run (or that the library would reject late, after spawning ranks)."""

    def planner_layout(self, dp: int, accumulation: int) -> Layout:
        raise NotImplementedError

    @property
    def recomputes_activations(self) -> bool:
        """Whether each block's forward runs again in backward (hardware FLOPs count it, model FLOPs do not)."""
        return False

    def loader_batch_size(self, micro_batch_size: int, accumulation: int) -> int:
        """Samples per rank per data-loader batch."""
        return micro_batch_size * accumulation if self.engine_runs_the_step else micro_batch_size

    def build(self, cfg: RunConfig, world_size: int, apply_checkpointing: object) -> StrategyBuild:
        raise NotImplementedError

    def model_placement(self, world_size: int) -> str:
        """Where a ``model=hf`` model's starting weights are made (models/hf.py): ``whole`` on every rank; ``rank0``
        where the strategy broadcasts rank 0's parameters when it wraps the model; ``deferred`` where its plan
        materializes them sharded."""
        return "whole"

    def user_module_plan(self, cfg: RunConfig, built: StrategyBuild) -> Callable[[Any, object], None] | None:
        """What the strategy applies to a user's LightningModule in its ``configure_model`` (after the user's own):
        the plan it applies to the built-in models, which for DDP is none and for DeepSpeed partitions any module."""
        return built.parallelize

    def build_module(
        self, cfg: RunConfig, accumulation: int, built: StrategyBuild, facts: ModelFacts
    ) -> pl.LightningModule:
        if isinstance(cfg.model, LightningModuleConfig):
            from disttrain.models.user_module import build_user_module

            return build_user_module(cfg.model, self.user_module_plan(cfg, built))
        from disttrain.models.factory import Fp8Linears, build_model_factory
        from disttrain.models.module import LanguageModelModule

        fp8 = None
        if cfg.precision.fp8:
            assert cfg.precision.recipe is not None  # validated
            fp8 = Fp8Linears(cfg.precision.recipe, fsdp_all_gather=self.name == "fsdp", head=cfg.precision.fp8_head)
        optimizer = cfg.optimizer
        if optimizer.fused is None and not self.fused_optimizer_ok:
            optimizer = replace(optimizer, fused=False)
        return LanguageModelModule(
            build_model_factory(cfg.model, cfg.trainer.seed, self.model_placement(cfg.hw.world_size), fp8=fp8),
            optimizer,
            max_steps=cfg.trainer.max_steps,
            parallelize=built.parallelize,
            flops_per_token=facts.flops_per_token,
            log_every_n_steps=cfg.trainer.log_every_n_steps,
            accumulation=accumulation,
            compile_loss=bool(cfg.model.compile),  # None: off
            cudagraphs=bool(cfg.model.compile) and getattr(cfg.model, "compile_mode", None) in CUDAGRAPH_MODES,
            onebit=built.onebit,
        )
