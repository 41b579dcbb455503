"""The run's parallel layout: the world, its data-parallel size and the batch plan, derived from the config by
the strategy's rules (``strategies.spec``), and ``validate_run``: every check of a run, the strategy's included.

Above config/ on purpose: config checks each group and the fields across groups; how many ranks share the data
and how a global batch splits into micro-batches is the strategy's to say (Megatron's tp x pp ranks hold one
replica; a pipeline runs several micro-batches per step).
"""

from __future__ import annotations

from disttrain.config.errors import ConfigError
from disttrain.config.schema import RunConfig
from disttrain.config.validate import BatchPlan, WorldLayout, validate_data_fits, validate_fields
from disttrain.strategies.spec import spec_of


def world_layout(cfg: RunConfig) -> WorldLayout:
    """DDP, FSDP and DeepSpeed shard data over every process; Megatron over world / (tp x pp) of them."""
    world = cfg.hw.world_size
    dp = spec_of(cfg.strategy).data_parallel_size(world)
    return WorldLayout(cfg.hw.num_nodes, cfg.hw.devices_per_node, world, dp)


def batch_plan(cfg: RunConfig) -> BatchPlan:
    """Global batch = micro x data-parallel size x micro-batches per step (accumulation, or Megatron's pipeline
    micro-batches times any further accumulation); ``accumulation`` counts micro-batches per rank per step."""
    t = cfg.trainer
    dp = world_layout(cfg).data_parallel_size
    rounds = spec_of(cfg.strategy).schedule_microbatches
    per_step = t.micro_batch_size * dp * rounds
    if t.global_batch_size is None:
        return BatchPlan(per_step, t.micro_batch_size, dp, rounds)
    if t.global_batch_size % per_step != 0:
        lower = max(per_step, t.global_batch_size // per_step * per_step)
        factors = f"{t.micro_batch_size} x {dp}" + (f" x {rounds} microbatches" if rounds > 1 else "")
        raise ConfigError(
            "trainer.global_batch_size",
            f"{t.global_batch_size} is not divisible by micro_batch_size x data-parallel size = {factors} = {per_step}",
            f"use a multiple of {per_step} (e.g. trainer.global_batch_size={lower}) or change trainer.micro_batch_size",
        )
    return BatchPlan(t.global_batch_size, t.micro_batch_size, dp, t.global_batch_size // per_step * rounds)


def validate_run(cfg: RunConfig) -> BatchPlan:
    """All checks of a run's config: the groups' own, the strategy's rules, the batch plan they imply and the data
    against it; returns the batch plan."""
    validate_fields(cfg)
    spec_of(cfg.strategy).validate(cfg)
    plan = batch_plan(cfg)
    validate_data_fits(cfg, plan)
    return plan
