"""The run's parallel layout (``ParallelLayout``): the world, the batch plan and the mesh degrees, derived once from
the config by the strategy's rules (``strategies.spec``), and ``validate_run``: every check of a run, the
strategy's included.

Above config/ on purpose: config checks each group and the fields across groups; how many ranks share the data
and how a global batch splits into micro-batches is the strategy's to say (Megatron's tp x pp ranks hold one
replica; a pipeline runs several micro-batches per step).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from disttrain.config.errors import ConfigError
from disttrain.config.schema import RunConfig
from disttrain.config.strategy_schema import AutoStrategyConfig, StrategyConfig
from disttrain.config.validate import BatchPlan, WorldLayout, validate_data_fits, validate_fields
from disttrain.planner import Layout
from disttrain.strategies.registry import spec_of


@dataclass(frozen=True)
class ParallelLayout:
    """How one run splits over its world, in the spirit of torchtitan's ``ParallelDims``: built once by ``prepare``
    and handed down to the build, the manifest, the prediction and the launch lines.

    ``mesh`` is the planner's strategy-neutral description (dp, tp, pp, ep, the shard group, micro-batches per
    step): what the memory and time formulas read, and what the run's FSDP2 and tensor-parallel facts derive from.
    """

    world: WorldLayout
    batch: BatchPlan
    mesh: Layout | None  # None only for strategy=auto, before prepare resolves it to a concrete layout

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def devices_per_node(self) -> int:
        return self.world.devices_per_node

    @property
    def tensor_parallel(self) -> int:
        return self.mesh.tp if self.mesh is not None else 1

    @property
    def fsdp_shard_ranks(self) -> int:
        """Ranks the run's FSDP2 units shard over: strategy=fsdp's, and strategy=megatron's data parallelism, which
        wraps its chunks in FSDP2 whatever its degree (1 under tp- or pp-only layouts); 0 for runs without FSDP2."""
        if self.mesh is None or self.mesh.strategy not in ("fsdp", "megatron"):
            return 0
        return self.mesh.dp_shard

    def attempt_record(self, attempt: int) -> dict[str, int]:
        """What run.json lists per attempt: a restart may train on another world (elastic), at the same batch."""
        return {
            "attempt": attempt,
            "world_size": self.world_size,
            "global_batch": self.batch.global_batch_size,
            "accumulation": self.batch.accumulation,
        }


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


def parallel_layout(cfg: RunConfig) -> ParallelLayout:
    """Every check of the run (``validate_run``), then its layout: the one place a run's world, batch plan and mesh
    are derived."""
    batch = validate_run(cfg)
    world = world_layout(cfg)
    if isinstance(cfg.strategy, AutoStrategyConfig):
        return ParallelLayout(world, batch, None)
    layout = layout_of(cfg.strategy, world, batch)
    if cfg.optimizer.name == "onebit_adam":  # validated: DDP only
        layout = replace(layout, onebit_adam=True)
    return ParallelLayout(world, batch, layout)


def layout_of(strategy: StrategyConfig, world: WorldLayout, batch: BatchPlan) -> Layout:
    """The planner's description of a DDP, FSDP2, DeepSpeed or Megatron run."""
    return spec_of(strategy).planner_layout(world.data_parallel_size, batch.accumulation)
