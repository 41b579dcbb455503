"""strategy=ddp: a full replica per rank, gradients all-reduced in buckets overlapped with backward.

``strategy.comm_hook`` registers one of torch's DDP communication hooks (``optimizer=onebit_adam`` its own).
Lightning's DDPStrategy registers hooks only on CUDA (a torch 1.8 restriction that no longer holds: gloo runs
them), so ``HookedDDPStrategy`` registers them on every device, and keeps a stateful hook's per-rank state
(PowerSGD's, 1-bit Adam's) beside each checkpoint.

``strategy.forward_sync_buffers`` is DDP's broadcast of rank 0's buffers before every forward (torch's default,
true). A model whose buffers never change (rotary caches, masks) does not need it, but turning it off is not a
sure gain (two A/Bs on 2 CPU ranks disagreed: benchmarks/RESULTS.md). Left at torch's default, for an A/B on
the user's hardware.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

from disttrain.config.strategy_schema import DDPConfig
from disttrain.strategies.checkpointing import UniversalCheckpointing
from disttrain.strategies.comm_hooks import build_comm_hook
from disttrain.strategies.loaders import ForkGuardedLoaders
from disttrain.strategies.onebit import OneBitComm, onebit_hook
from disttrain.strategies.powersgd import PowerSGDComm


def register_comm_hook(model: DistributedDataParallel, state: object | None, hook: Callable | None) -> None:
    """Register ``hook`` on a DDP-wrapped model (a no-op without one)."""
    if hook is None:
        return
    if isinstance(state, PowerSGDComm):
        state.bind(model)
    model.register_comm_hook(state=state, hook=hook)


# torch 2.13 renamed DDP's ``broadcast_buffers`` (deprecated; false also skipped the sync when DDP wraps the model).
FORWARD_SYNC_KWARG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)


class RankStateCheckpointing:
    """Keeps a per-rank state (PowerSGD's or 1-bit Adam's error feedback: it differs per rank) in one file per rank
    beside each checkpoint, and restores it on resume. ``rank_state`` has ``name``, ``state_path(ckpt, rank)``,
    ``state_dict(world_size)`` and ``load_state_dict(saved, world_size) -> dropped``; None: nothing to keep."""

    global_rank: int
    world_size: int

    @property
    def rank_state(self) -> Any:
        return None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
        state = self.rank_state
        if state is None:
            return
        # Every rank writes its own file: gathering the states would put world x gradient size on rank 0.
        path = state.state_path(filepath, self.global_rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state.state_dict(self.world_size), path)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        if self.rank_state is not None:
            self._load_rank_state(Path(checkpoint_path))
        return checkpoint

    def _load_rank_state(self, checkpoint_path: Path) -> None:
        state = self.rank_state
        own = state.state_path(checkpoint_path, self.global_rank)
        # A rank that did not exist when the checkpoint was written takes rank 0's file: what is the same on every
        # rank (step counts, PowerSGD's warm-start factors) keeps all ranks in step (same collectives).
        path = own if own.is_file() else state.state_path(checkpoint_path, 0)
        if not path.is_file():
            rank_zero_warn(
                f"{checkpoint_path} has no {state.name} state (saved without {state.config_key}): {state.name} "
                f"starts afresh{state.afresh}"
            )
            return
        dropped = state.load_state_dict(torch.load(path, weights_only=True), self.world_size)
        if dropped:
            rank_zero_warn(f"{state.name} resumed without its {'; '.join(dropped)}: they start from zero")


class HookedDDPStrategy(ForkGuardedLoaders, RankStateCheckpointing, UniversalCheckpointing, DDPStrategy):
    """DDPStrategy that registers its comm hook on any device and checkpoints a stateful hook's per-rank state."""

    @property
    def rank_state(self) -> Any:
        return self._ddp_comm_state if isinstance(self._ddp_comm_state, PowerSGDComm | OneBitComm) else None

    def _register_ddp_hooks(self) -> None:
        register_comm_hook(self.model, self._ddp_comm_state, self._ddp_comm_hook)  # type: ignore[arg-type]


class OneProcessStrategy(ForkGuardedLoaders, RankStateCheckpointing, UniversalCheckpointing, SingleDeviceStrategy):
    """One process (DDP's world of 1): Lightning's single-device strategy, with the universal checkpoint layout
    (and 1-bit Adam's error feedback, which one process has too)."""

    def __init__(self, device: torch.device, onebit: OneBitComm | None = None) -> None:
        super().__init__(device=device)
        self._onebit = onebit

    @property
    def rank_state(self) -> Any:
        return self._onebit


def build_one_process(accelerator: str, onebit: OneBitComm | None = None) -> OneProcessStrategy:
    return OneProcessStrategy(torch.device("cuda", 0) if accelerator == "gpu" else torch.device("cpu"), onebit)


def build_ddp(cfg: DDPConfig, backend: str, onebit: OneBitComm | None = None) -> DDPStrategy:
    """DDP with ``cfg``'s comm hook, or with 1-bit Adam's (all-reduce until its freeze, then none)."""
    state, hook = (onebit, onebit_hook) if onebit is not None else build_comm_hook(cfg, backend)
    return HookedDDPStrategy(
        process_group_backend=backend,
        find_unused_parameters=cfg.find_unused_parameters,
        gradient_as_bucket_view=cfg.for_accelerator("gpu" if backend == "nccl" else "cpu").gradient_as_bucket_view,
        bucket_cap_mb=cfg.bucket_cap_mb,
        static_graph=cfg.static_graph,
        **({} if cfg.forward_sync_buffers else {FORWARD_SYNC_KWARG: False}),  # true: DDP's default, no warning
        ddp_comm_state=state,
        ddp_comm_hook=hook,
    )
