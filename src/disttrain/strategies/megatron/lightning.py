"""Lightning's side of ``strategy=megatron``: the 4-axis DeviceMesh, data sharding over dp only, DCP checkpoints.

ModelParallelStrategy already owns process-group setup, FSDP2/DTensor-aware (distributed) checkpointing and
materialization; it only knows a 2-axis (data, tensor) mesh, so the mesh and the sampler arguments change here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.optim import Optimizer

from disttrain.config.degrees import MegatronDegrees
from disttrain.strategies.megatron.engine import build_mesh


class MegatronStrategy(ModelParallelStrategy):
    def __init__(self, degrees: MegatronDegrees, backend: str) -> None:
        super().__init__(
            data_parallel_size=degrees.dp,
            tensor_parallel_size=degrees.tp,
            save_distributed_checkpoint=True,
            process_group_backend=backend,
        )
        self.degrees = degrees

    def setup_environment(self) -> None:
        self._setup_distributed()
        if self.world_size != self.degrees.world_size:
            raise RuntimeError(
                f"strategy=megatron was planned for {self.degrees.world_size} processes but {self.world_size} started"
            )
        self._device_mesh = build_mesh(self.degrees, self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Ranks that differ only in their tp or pp coordinate must see the same samples.
        return {"num_replicas": self.degrees.dp, "rank": self.degrees.coordinates(self.global_rank)["dp"]}

    # Pipeline ranks hold different parameters, so their optimizer param_groups differ; torch.distributed.checkpoint
    # keeps one copy of non-tensor entries, which would hand every rank rank 0's groups on load. Flattened optimizer
    # state dicts key every hyper-parameter by parameter name instead (torchtitan does the same).
    _OPTIMIZER_OPTIONS: ClassVar[dict[str, bool]] = {"cpu_offload": True, "flatten_optimizer_state_dict": True}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return get_optimizer_state_dict(self.model, optimizer, options=StateDictOptions(**self._OPTIMIZER_OPTIONS))

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.model is not None
        model_state = {"state_dict": get_model_state_dict(self.model)}
        dcp.load(model_state, checkpoint_id=path)
        set_model_state_dict(self.model, model_state["state_dict"])
        options = StateDictOptions(**self._OPTIMIZER_OPTIONS)
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            state = {key: get_optimizer_state_dict(self.model, optimizer, options=options)}
            dcp.load(state, checkpoint_id=path)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state[key], options=options)
        # Loop, scheduler and callback states: plain containers, so no pickle beyond weights_only is needed.
        return torch.load(path / _METADATA_FILENAME, weights_only=True if weights_only is None else weights_only)
