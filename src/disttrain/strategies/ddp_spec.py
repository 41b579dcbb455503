"""strategy=ddp's spec: a full replica per rank (the config checks of its comm hooks and 1-bit Adam, its layout)."""

from __future__ import annotations

from disttrain.config.errors import ConfigError, did_you_mean
from disttrain.config.schema import RunConfig
from disttrain.config.strategy_schema import (
    COMM_HOOKS,
    DDPConfig,
)
from disttrain.planner import Layout
from disttrain.strategies.spec import StrategyBuild, StrategySpec, process_group_backend


class DDPSpec(StrategySpec):
    name = "ddp"
    wraps_one_process = False  # one process needs no replica synchronisation: Lightning's single-device strategy
    ranks_hold_the_whole_module = True

    def validate(self, cfg: RunConfig) -> None:
        """Bucket size and communication hook: a hook that cannot help this run is refused, not silently ignored."""
        ddp: DDPConfig = self.config
        if ddp.bucket_cap_mb <= 0:
            raise ConfigError("strategy.bucket_cap_mb", "must be > 0", "use strategy.bucket_cap_mb=25")
        if ddp.comm_hook not in COMM_HOOKS:
            raise ConfigError(
                "strategy.comm_hook",
                f"unknown hook '{ddp.comm_hook}'{did_you_mean(ddp.comm_hook, COMM_HOOKS)}",
                f"use one of {list(COMM_HOOKS)}",
            )
        if ddp.comm_hook == "none":
            return
        if cfg.hw.world_size == 1:
            raise ConfigError(
                "strategy.comm_hook",
                f"'{ddp.comm_hook}' compresses the gradient all-reduce, but a world size of 1 communicates nothing",
                "set strategy.comm_hook=none, or run more than one process (hw.devices_per_node / hw.num_nodes)",
            )
        if ddp.comm_hook in ("bf16", "fp16") and cfg.precision.name == "bf16-true":
            raise ConfigError(
                "strategy.comm_hook",
                f"under precision=bf16-true the gradients are already 2-byte bf16: the {ddp.comm_hook} hook sends "
                "the same bytes" + (" with fp16's narrower range" if ddp.comm_hook == "fp16" else ""),
                "set strategy.comm_hook=none (or powersgd to send fewer bytes)",
            )
        if ddp.comm_hook == "powersgd":
            self._validate_powersgd(cfg.trainer.max_steps)

    def _validate_powersgd(self, max_steps: int) -> None:
        ddp: DDPConfig = self.config
        if ddp.powersgd_rank < 1:
            raise ConfigError(
                "strategy.powersgd_rank", f"must be >= 1, got {ddp.powersgd_rank}", "use strategy.powersgd_rank=4"
            )
        if ddp.powersgd_warmup_steps < 2:
            # torch's PowerSGDState refuses start_powerSGD_iter <= 1 with warm start / error feedback: DDP rebuilds
            # its buckets after the first step, which would invalidate state kept per bucket.
            raise ConfigError(
                "strategy.powersgd_warmup_steps",
                f"must be >= 2 (DDP regroups its gradient buckets after the first step), got "
                f"{ddp.powersgd_warmup_steps}",
                "use strategy.powersgd_warmup_steps=2 or more",
            )
        if ddp.powersgd_warmup_steps >= max_steps:
            raise ConfigError(
                "strategy.powersgd_warmup_steps",
                f"{ddp.powersgd_warmup_steps} plain all-reduce steps leave no PowerSGD step before "
                f"trainer.max_steps={max_steps}",
                f"use strategy.powersgd_warmup_steps < {max_steps}",
            )

    def planner_layout(self, dp: int, accumulation: int) -> Layout:
        return Layout("ddp", dp=dp, microbatches=accumulation)

    def model_placement(self, world_size: int) -> str:
        # DistributedDataParallel broadcasts rank 0's parameters and buffers when it wraps the model.
        return "rank0" if world_size > 1 else "whole"

    def build(self, cfg: RunConfig, world_size: int, apply_checkpointing: object) -> StrategyBuild:
        from disttrain.strategies.ddp import build_ddp
        from disttrain.strategies.onebit import OneBitComm

        onebit = OneBitComm(cfg.optimizer.freeze_steps) if cfg.optimizer.name == "onebit_adam" else None
        backend = process_group_backend(cfg.hw.accelerator)
        return StrategyBuild(build_ddp(self.config, backend, onebit), None, cfg.precision.lightning, onebit)
