"""strategy=deepspeed: DeepSpeed ZeRO stage 1/2/3 through Lightning's DeepSpeedStrategy, on GPUs and on CPU.

Lightning's strategy refuses anything but CUDA. DeepSpeed itself runs on CPU (its CPU accelerator, gloo), so
``CPUCapableDeepSpeedStrategy`` changes only what assumes CUDA: the accelerator check in environment setup, the
device-index check (CPU devices have no index) and the ``device_rank`` handed to ``deepspeed.initialize``. On CPU
DeepSpeed would also JIT-compile its shared-memory all-reduce (about a minute of g++ per process); marking that op
incompatible keeps plain gloo. The optimizer is the LightningModule's torch AdamW (DeepSpeed's fused Adam would be
compiled too), except under optimizer offload on GPUs, where DeepSpeed steps the host partition with its CPU Adam.

ZeRO-3 partitions parameters as soon as they exist, before the optimizer ever sees them. The reference model is
built whole from the meta device with its deterministic init (so every rank computes the same values a single
process would), then ``zero.Init(module=...)`` keeps each rank's slice and frees the rest. A ``model=hf`` model is
built partitioned: its parameters stay on the meta device until ``partition_parameters`` gives them storage one
module at a time, rank 0's values broadcast and partitioned before the next module is allocated.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from torch import nn

from disttrain.checkpoint import universal
from disttrain.config.strategy_schema import DeepSpeedConfig
from disttrain.planner.terms.deepspeed import NVME_SUB_GROUP
from disttrain.strategies import deepspeed_state as ds
from disttrain.strategies.checkpointing import UniversalCheckpointing
from disttrain.strategies.deepspeed_state import full_model_state, full_optimizer_state, partition_numels
from disttrain.strategies.loaders import ForkGuardedLoaders

# DeepSpeed's op name for its CPU shared-memory collectives (deepspeed/ops/op_builder/cpu/comm.py).
SHM_COMM_OP = "deepspeed_shm_comm"


def deepspeed_config(
    cfg: DeepSpeedConfig, micro_batch_size: int, param_buffer_elements: int | None = None
) -> dict[str, Any]:
    """The DeepSpeed JSON config for these options.

    Lightning fills in what the Trainer owns: ``gradient_accumulation_steps`` (from accumulate_grad_batches),
    ``gradient_clipping`` (from gradient_clip_val) and the bf16/fp16 sections (from precision).
    ``param_buffer_elements``: the swap buffers' size under parameter offload to NVMe
    (``planner.terms.deepspeed.nvme_param_buffer_elements``; DeepSpeed's default where the model's shape is unknown).
    """
    zero: dict[str, Any] = {
        "stage": cfg.stage,
        "overlap_comm": cfg.overlap_comm,
        "contiguous_gradients": cfg.contiguous_gradients,
        "reduce_scatter": True,
        "reduce_bucket_size": cfg.reduce_bucket_size,
        "allgather_partitions": True,
        "allgather_bucket_size": cfg.allgather_bucket_size,
    }
    if cfg.stage == 3:
        zero["stage3_param_persistence_threshold"] = cfg.param_persistence_threshold
    offloads = (("offload_optimizer", cfg.optimizer_offload_device), ("offload_param", cfg.param_offload_device))
    for key, device in offloads:
        if device is not None:
            zero[key] = {"device": device, "pin_memory": True}
            if device == "nvme":  # DeepSpeed's async I/O defaults (block size, queue depth) stand
                zero[key]["nvme_path"] = cfg.nvme_path
    if cfg.param_offload_device == "nvme" and param_buffer_elements:
        zero["offload_param"]["buffer_size"] = param_buffer_elements
    if cfg.optimizer_offload_device == "nvme":
        zero["sub_group_size"] = NVME_SUB_GROUP  # the size of each pinned swap buffer (planner/terms/deepspeed.py)
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "zero_optimization": zero,
        # The optimizer is the LightningModule's torch AdamW, which DeepSpeed calls "untested" with ZeRO.
        "zero_allow_untested_optimizer": True,
    }


def deepspeed_arch_list(value: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's JIT builder parses it: it reads each entry as dot-separated integers,
    so the arch-specific suffix of entries like ``9.0a`` (a CUDA image's setting) fails its build of the async I/O
    op that NVMe offload loads; the suffix-free arch builds the same op for that GPU."""
    kept: list[str] = []
    for entry in value.replace(" ", ";").split(";"):
        arch, ptx = (entry[:-4], "+PTX") if entry.endswith("+PTX") else (entry, "")
        arch = arch.strip().rstrip("abcdefghijklmnopqrstuvwxyz")
        if arch and arch + ptx not in kept:
            kept.append(arch + ptx)
    return ";".join(kept)


def remove_swap_files(swap_folder: Path, rank: int) -> None:
    """This rank's ZeRO-Infinity swap files (DeepSpeed's ``zero_stage_3/*/rank<r>`` under the run's own folder),
    then whatever folders that leaves empty: each rank removes only its own, so none races another."""
    for folder in swap_folder.glob(f"zero_stage_3/*/rank{rank}"):
        shutil.rmtree(folder, ignore_errors=True)
    emptied = [*sorted(swap_folder.glob("zero_stage_3/*")), swap_folder / "zero_stage_3", swap_folder]
    for folder in emptied:
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty: another rank's files stay


def disable_shm_comm_build() -> None:
    """Keep DeepSpeed on plain gloo collectives on CPU instead of JIT-compiling its shared-memory op."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


class CPUCapableDeepSpeedStrategy(ForkGuardedLoaders, UniversalCheckpointing, DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy, unchanged on GPUs; on CPU it skips the three CUDA-only assumptions.

    Checkpoints are the universal layout: ZeRO partitions gathered under single-process names on save and scattered
    back on load (``strategies/deepspeed_state.py``), in place of DeepSpeed's per-rank files.
    """

    swap_folder: Path | None = None  # this run's own folder under strategy.nvme_path (ZeRO-Infinity), if any

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return full_model_state(self.lightning_module)

    def teardown(self) -> None:
        super().teardown()
        if self.swap_folder is not None:
            remove_swap_files(self.swap_folder, self.global_rank)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return full_optimizer_state(self.lightning_module, self.deepspeed_engine.optimizer)

    def writer_facts(self) -> dict[str, Any]:
        """The ZeRO stage and what each rank held: its flat fp32 partition per group and (stage 3) its slice of the
        model's own parameters, so a checkpoint shows the partitioning it came from (the full tensors do not)."""
        mine = partition_numels(self.lightning_module, self.deepspeed_engine.optimizer)
        held: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(held, mine)
        return {"zero_stage": self.config["zero_optimization"]["stage"], "ranks": held}

    def load_universal(self, path: Path) -> None:
        module, zero = self.lightning_module, self.deepspeed_engine.optimizer
        index = universal.saved_keys(path)
        model_state = ds.model_template(module)
        states: list[dict[str, Any]] = []
        keys: tuple[str, ...] = ()
        if not self.resume_weights_only:
            names = [names[0] for names in ds.param_names(module).values()]
            keys = ds.moment_keys(index, universal.optimizer_key(0), names)
            with_step = ds.saves_step(index, universal.optimizer_key(0), names)
            states = [ds.optimizer_template(module, zero, keys, with_step)]
        universal.read_into(path, model_state, states, index)
        ds.load_model_state(module, zero, model_state)
        if states:
            ds.load_optimizer_state(module, zero, states[0], keys)

    def _on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    def _offloads_optimizer(self) -> bool:
        return "offload_optimizer" in (self.config or {}).get("zero_optimization", {})

    def setup_environment(self) -> None:
        if not self._on_cpu():
            super().setup_environment()
            return
        disable_shm_comm_build()
        # Skip DeepSpeedStrategy's CUDA-only check; DDPStrategy's setup then calls our setup_distributed.
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        if not self._on_cpu():
            super().setup_distributed()
            return
        from lightning.fabric.utilities.seed import reset_seed

        # CPU devices carry no index, so DeepSpeedStrategy's device-index check cannot hold; the rest is its setup.
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Lightning's loop already divides the loss by accumulate_grad_batches; DeepSpeed's engine would divide it
        # again (Lightning-AI/pytorch-lightning#6170), leaving gradients 1/accumulation too small, which gradient
        # clipping and Adam's eps then turn into different updates than any other strategy's.
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @contextlib.contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        # Lightning would construct the model inside zero.Init, whose constructor hooks materialize every tensor
        # on the real device (defeating our meta-device build and deterministic init). ZeRO-3 partitioning is
        # applied right after the build instead, by ``partition_parameters``.
        self._init_config_if_needed()
        yield

    def partition_parameters(self, model: nn.Module) -> None:
        """ZeRO-3: keep only this rank's slice of every parameter (a no-op for stages 1 and 2)."""
        if self.zero_stage_3:
            partition_model(model, self.config, self.remote_device, self.global_rank)
            move_buffers(model, self.root_device)

    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[Any, Any]:
        if optimizer is not None and self._offloads_optimizer():
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = swap_optimizer(optimizer, lr_scheduler, DeepSpeedCPUAdam)
        if not self._on_cpu():
            return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)
        import deepspeed

        # Lightning passes root_device.index, which is None for a CPU device; DeepSpeed wants the local rank.
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer


def partition_model(model: nn.Module, config: dict[str, Any], remote_device: str | None, rank: int) -> int | None:
    """ZeRO-3 partitioning of ``model`` on this rank; returns the most elements held unpartitioned at once when the
    model was built deferred, else None.

    A model built with deferred parameters (``model=hf``: on the meta device) is materialized one module at a time,
    each partitioned before the next is allocated, so no rank ever holds the whole model: rank 0 writes the values
    (its deterministic init or its read of ``model.path``) and zero.Init broadcasts each module's from rank 0 as it
    partitions them. Any other model is partitioned whole, after its build."""
    import deepspeed

    def partition(module: nn.Module) -> None:
        deepspeed.zero.Init(module=module, config_dict_or_path=config, remote_device=remote_device)

    materialize = getattr(model, "materialize_by_module", None)
    if callable(materialize) and getattr(model, "deferred", False):
        return materialize(fill=rank == 0, partition=lambda params: partition(nn.ParameterList(params)))
    partition(model)
    return None


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Every buffer (RoPE tables) to ``device``. zero.Init places the parameters it partitions, and DeepSpeed's
    engine then leaves a partitioned model where it is, so nothing else would move the buffers off the host."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def swap_optimizer(optimizer: torch.optim.Optimizer, lr_scheduler: Any, cls: type) -> torch.optim.Optimizer:
    """The same Adam(W) as ``optimizer`` (groups, weight decay, lr, betas, eps) built as ``cls``.

    Under optimizer offload DeepSpeed steps the host partition with its vectorised CPU Adam (it refuses a torch
    optimizer there by default). The lr schedule keeps driving the new optimizer's groups.
    """
    d = optimizer.defaults
    groups = [
        {k: v for k, v in group.items() if k in ("params", "weight_decay", "lr")} for group in optimizer.param_groups
    ]
    swapped = cls(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"])
    for old, new in zip(optimizer.param_groups, swapped.param_groups, strict=True):
        if "initial_lr" in old:  # set by the lr scheduler when it was built on the original optimizer
            new["initial_lr"] = old["initial_lr"]
    if lr_scheduler is not None:
        lr_scheduler.optimizer = swapped
    return swapped


def apply_deepspeed(
    model: nn.Module,
    mesh: object,
    cfg: DeepSpeedConfig,
    strategy: CPUCapableDeepSpeedStrategy,
    apply_checkpointing: Callable[[nn.Module], None],
) -> None:
    """The plan run in ``configure_model``: optional activation checkpointing, then ZeRO-3 partitioning."""
    if cfg.activation_checkpointing and getattr(model, "blocks", None) is not None:
        apply_checkpointing(model)
    strategy.partition_parameters(model)


def build_deepspeed(
    cfg: DeepSpeedConfig,
    micro_batch_size: int,
    backend: str,
    apply_checkpointing: Callable[[nn.Module], None],
    param_buffer_elements: int | None = None,
) -> tuple[CPUCapableDeepSpeedStrategy, Callable[[nn.Module, object], None]]:
    """The strategy and the plan ``LightningModule.configure_model`` applies to the freshly built model."""
    if backend == "gloo":
        # On a CPU, DeepSpeed's import finds no GPU and warns on every rank that it is "Setting accelerator to CPU";
        # saying so first keeps that line off the console (a user's own DS_ACCELERATOR wins).
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    strategy = CPUCapableDeepSpeedStrategy(
        config=deepspeed_config(cfg, micro_batch_size, param_buffer_elements), process_group_backend=backend
    )
    if cfg.uses_nvme:
        assert cfg.nvme_path is not None  # validated, then made this run's own folder (nvme_swap_folder)
        strategy.swap_folder = Path(cfg.nvme_path)
        if os.environ.get("TORCH_CUDA_ARCH_LIST"):
            os.environ["TORCH_CUDA_ARCH_LIST"] = deepspeed_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])

    def plan(model: nn.Module, mesh: object) -> None:
        apply_deepspeed(model, mesh, cfg, strategy, apply_checkpointing)

    return strategy, plan
