"""Lightning's side of ``strategy=megatron``: the 4-axis DeviceMesh, data sharding over dp only.

ModelParallelStrategy already owns process-group setup and materialization; it only knows a 2-axis (data, tensor)
mesh, so the mesh and the sampler arguments change here. Checkpoints are the universal layout
(``strategies/checkpointing.py``): pipeline ranks hold different parameters, and the flattened optimizer state keys
every hyper-parameter by parameter name, so each rank gets its own groups back (torchtitan does the same).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

from disttrain.config.degrees import MegatronDegrees
from disttrain.strategies.checkpointing import UniversalCheckpointing
from disttrain.strategies.loaders import ForkGuardedLoaders
from disttrain.strategies.megatron.engine import build_mesh


class MegatronStrategy(ForkGuardedLoaders, UniversalCheckpointing, ModelParallelStrategy):
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
