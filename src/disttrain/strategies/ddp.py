"""strategy=ddp: a full replica per rank, gradients all-reduced in buckets overlapped with backward."""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy

from disttrain.config.schema import DDPConfig


def build_ddp(cfg: DDPConfig, backend: str) -> DDPStrategy:
    return DDPStrategy(
        process_group_backend=backend,
        find_unused_parameters=cfg.find_unused_parameters,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        bucket_cap_mb=cfg.bucket_cap_mb,
        static_graph=cfg.static_graph,
    )
