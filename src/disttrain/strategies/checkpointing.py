"""Every strategy's checkpoint save and load, in the one layout of ``disttrain.checkpoint.universal``.

``UniversalCheckpointing`` is mixed into each Lightning strategy this project builds (DDP and its one-process
form, FSDP2, Megatron; DeepSpeed overrides the three state hooks in ``strategies/deepspeed_state.py``). It replaces
Lightning's per-strategy formats: the model state comes from ``get_model_state_dict`` (single-process names, full
tensors or DTensor shards) and the optimizer's from ``get_optimizer_state_dict`` flattened by parameter name, both
written with torch.distributed.checkpoint, so any strategy reads what any other wrote, resharded on load.

Loading happens after setup (``restore_checkpoint_after_setup``): the model is wrapped and sharded and the optimizer
exists, so DCP reads straight into this run's layout. A checkpoint in a strategy's older own format (a DDP file, a
DeepSpeed ZeRO dir) is still read by the parent strategy, for the same strategy only (``job/prepare.py`` refuses the
rest before launch).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import Optimizer

from disttrain.checkpoint import universal
from disttrain.checkpoint.loops import restate_fit_loop
from disttrain.strategies.expert_checkpoint import ExpertViews


def unwrap(optimizer: Optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class UniversalCheckpointing:
    """Mixin for a Lightning ``Strategy``: save and load the universal layout (see the module docstring)."""

    lightning_module: Any  # the Strategy's, which this mixin is combined with

    # Set by the launch when resume_weights_only=true: the optimizer starts afresh (its moments are not read).
    resume_weights_only: bool = False
    _universal_loaded: bool = False

    # ---- what is saved -------------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.lightning_module, options=StateDictOptions(cpu_offload=True))
        views = ExpertViews(self.lightning_module)
        return views.model_state(state) if views else state

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = get_optimizer_state_dict(
            self.lightning_module, unwrap(optimizer), options=universal.flat_optimizer_options()
        )
        views = ExpertViews(self.lightning_module)
        return views.optimizer_state(state) if views else state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        path = Path(self.broadcast(str(filepath)))  # type: ignore[attr-defined]
        model_state = checkpoint.pop("state_dict")
        optimizer_states = checkpoint.pop("optimizer_states", [])
        checkpoint[universal.FORMAT_KEY] = {
            "format": universal.FORMAT,
            "strategy": type(self).__name__,
            "world_size": self.world_size,  # type: ignore[attr-defined]
            **self.writer_facts(),
        }
        universal.save(path, model_state, optimizer_states, checkpoint, self.is_global_zero)  # type: ignore[attr-defined]

    def writer_facts(self) -> dict[str, Any]:
        """What else the checkpoint records about the layout that wrote it (a collective; nothing by default)."""
        return {}

    # ---- how it is read ------------------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # read into the wrapped/sharded model and the built optimizer

    @property
    def lightning_restore_optimizer(self) -> bool:
        if self._universal_loaded or self.resume_weights_only:
            return False  # read by load_universal already, or not at all on purpose
        return super().lightning_restore_optimizer  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))  # type: ignore[attr-defined]
        self._universal_loaded = universal.is_universal(path)
        if not self._universal_loaded:
            return super().load_checkpoint(path, weights_only=weights_only)  # type: ignore[misc]
        self.load_universal(path)
        meta = universal.read_meta(path, weights_only)
        self.restate_loops(meta)
        self.restore_scheduled_lr(meta)
        return meta

    def restore_scheduled_lr(self, meta: dict[str, Any]) -> None:
        """Each optimizer group's lr as its schedule last set it (``_last_lr``).

        The flattened optimizer state carries it already; a checkpoint that kept its groups in another layout (FSDP2
        before the shared layout) does not, and the first resumed step would run at the freshly built optimizer's lr.
        """
        optimizers = [unwrap(o) for o in self.optimizers]  # type: ignore[attr-defined]
        schedules = meta.get("lr_schedulers") or []
        if len(schedules) != len(optimizers):
            return
        for optimizer, schedule in zip(optimizers, schedules, strict=True):
            last = schedule.get("_last_lr") if isinstance(schedule, dict) else None
            if last is not None and len(last) == len(optimizer.param_groups):
                for group, lr in zip(optimizer.param_groups, last, strict=True):
                    group["lr"] = lr

    def restate_loops(self, meta: dict[str, Any]) -> None:
        """The loop counters as this run counts steps (another accumulation or optimization mode than the writer's)."""
        module = self.lightning_module  # type: ignore[attr-defined]
        fit_loop = meta.get("loops", {}).get("fit_loop")
        if fit_loop is None:
            return
        trainer = module.trainer
        batches_per_step = trainer.accumulate_grad_batches if module.automatic_optimization else 1
        restate_fit_loop(fit_loop, int(meta.get("global_step", 0)), batches_per_step, not module.automatic_optimization)

    def load_universal(self, path: Path) -> None:
        """Read the model (and unless ``resume_weights_only`` the optimizer) into this run's objects."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        module = self.lightning_module  # type: ignore[attr-defined]
        optimizers = [] if self.resume_weights_only else [unwrap(o) for o in self.optimizers]  # type: ignore[attr-defined]
        options = universal.flat_optimizer_options()
        model_state = get_model_state_dict(module)
        optimizer_states = [get_optimizer_state_dict(module, o, options=options) for o in optimizers]
        twins = getattr(module, "tied_twins", None)
        # Expert-parallel experts are read as their slice of the one-process tensors (strategies/expert_checkpoint).
        views = ExpertViews(module)
        viewed = [views.optimizer_state(s) for s in optimizer_states] if views else optimizer_states
        universal.read_into(path, views.model_state(model_state) if views else model_state, viewed, twins=twins)
        for state, loaded in zip(optimizer_states, viewed, strict=True):
            if views:
                views.read_back(state, loaded)
        set_model_state_dict(module, model_state, options=StateDictOptions(strict=True))
        for optimizer, state in zip(optimizers, optimizer_states, strict=True):
            set_optimizer_state_dict(module, optimizer, optim_state_dict=state, options=options)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._universal_loaded:
            super().load_model_state_dict(checkpoint, strict=strict)  # type: ignore[misc]

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._universal_loaded:
            super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]
