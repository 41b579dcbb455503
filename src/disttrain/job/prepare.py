"""One job, checked and resolved before anything is spawned: ``prepare`` and the launch check.

``prepare`` finds the resume point (re-composing the resumed run's config), parses and validates the typed
config, resolves ``strategy=auto`` and guards the run dir. ``preflight`` (before Hydra) and ``run_from_hydra``
(inside the job) both call it, so both paths apply the same checks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hydra import compose
from hydra.errors import HydraException
from omegaconf import DictConfig

from disttrain.checkpoint.resume import ResumePoint, find_resume_point, newest_complete, original_overrides, run_dir_of
from disttrain.config.errors import ConfigError
from disttrain.config.hardware import HardwareProfile
from disttrain.config.parse import parse_run_config
from disttrain.config.schema import AutoStrategyConfig, RunConfig
from disttrain.config.validate import BatchPlan, WorldLayout, batch_plan, validate_run, world_layout
from disttrain.launch.env import process_role
from disttrain.planner.auto import check_fits, predict_memory, resolve_auto


@dataclass(frozen=True)
class Prepared:
    """A validated job: the config it runs with (re-composed on resume) and where it resumes from."""

    cfg: DictConfig
    run_cfg: RunConfig
    layout: WorldLayout
    plan: BatchPlan
    auto_reason: str | None
    resume: ResumePoint | None
    attempt: int


def resolve(cfg: DictConfig) -> tuple[RunConfig, WorldLayout, BatchPlan, str | None]:
    """Typed config, world layout and batch plan; ``strategy=auto`` resolved; every cross-field check run."""
    run_cfg = parse_run_config(cfg)
    layout = world_layout(run_cfg)
    auto_reason = None
    if isinstance(run_cfg.strategy, AutoStrategyConfig):
        run_cfg, auto_reason = resolve_auto(run_cfg, layout, batch_plan(run_cfg))
        layout = world_layout(run_cfg)
    plan = validate_run(run_cfg)
    return run_cfg, layout, plan, auto_reason


def compose_for_resume(resume: str, task_overrides: list[str]) -> DictConfig:
    """The resumed run's config: its original overrides, then this command's (later ones win)."""
    keep = [o for o in original_overrides(resume) + task_overrides if not o.lstrip("+~").startswith("resume=")]
    try:
        return compose(config_name="train", overrides=[*keep, f"resume={resume}"])
    except HydraException as err:
        raise ConfigError(
            "resume",
            f"the run's recorded overrides plus this command's do not compose ({str(err).splitlines()[0]})",
            f"check {run_dir_of(Path(resume))}/.hydra/overrides.yaml and the overrides given with resume=",
        ) from None


def existing_run(run_dir: Path) -> str | None:
    """What marks ``run_dir`` as holding a run already (its manifest or Hydra's record), or None."""
    for marker in ("run.json", ".hydra/overrides.yaml"):
        if (run_dir / marker).exists():
            return marker
    return None


def refuse_existing_run(run_dir: Path, marker: str) -> None:
    raise ConfigError(
        "hydra.run.dir",
        f"'{run_dir}' already holds a run ({marker}); it is never written over",
        "pass hydra.run.dir=<new dir> (or start again in a moment); to continue that run use resume=<that dir>",
    )


def check_world_size(layout: WorldLayout) -> None:
    """Under torchrun/SLURM the launcher decides the process count: it must match what the config describes."""
    role = process_role()
    launched = role.launched_world_size
    if role.child or launched is None:
        return
    if not any(k in os.environ for k in ("SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "GROUP_RANK")):
        return  # WORLD_SIZE without a cluster launcher is our own rank-0 environment (or a stale export)
    if launched != layout.world_size:
        raise ConfigError(
            "hw.devices_per_node",
            f"the launcher started {launched} processes but the config describes hw.num_nodes x "
            f"hw.devices_per_node = {layout.num_nodes} x {layout.devices_per_node} = {layout.world_size}",
            f"set hw.num_nodes/hw.devices_per_node so their product is {launched}, or launch "
            f"{layout.world_size} processes",
        )


def prepare(cfg: DictConfig, run_dir: Path | None, task_overrides: list[str]) -> Prepared:
    """All checks of one job before anything is spawned; ``run_dir`` None skips the run-dir guard."""
    role = process_role()
    attempt = role.attempt
    # Only global rank 0 guards: under SLURM/torchrun the other ranks may start after rank 0 wrote run.json.
    if run_dir is not None and attempt == 0 and role.is_global_zero and (run_dir / "run.json").exists():
        # Two runs started within the same second share Hydra's timestamped dir: never write over the first.
        refuse_existing_run(run_dir, "run.json")
    point: ResumePoint | None = None
    if cfg.get("resume"):
        point = find_resume_point(str(cfg.resume))
        cfg = compose_for_resume(str(cfg.resume), task_overrides)
    if attempt > 0 and run_dir is not None:
        # A restarted job continues from its own newest complete checkpoint (else from where it started).
        point = newest_complete(run_dir / "checkpoints") or point
    run_cfg, layout, plan, auto_reason = resolve(cfg)
    check_world_size(layout)
    if point is not None:
        from disttrain.checkpoint.shapes import check_checkpoint_fits_model  # imports torch: only on resume

        check_checkpoint_fits_model(point.checkpoint, run_cfg.model, run_cfg.trainer.seed)
    return Prepared(cfg, run_cfg, layout, plan, auto_reason, point, attempt)


def check_launchable(prepared: Prepared, here: bool = True) -> None:
    """What ``run_from_hydra`` refuses before spawning: the memory prediction, and (``here``) missing devices."""
    run_cfg = prepared.run_cfg
    if run_cfg.dry_run:
        return
    memory = predict_memory(run_cfg, prepared.layout, prepared.plan)
    check_fits(run_cfg, memory, run_cfg.check_memory)
    if not here:
        return
    cuda_devices = 0
    if run_cfg.hw.accelerator == "gpu":
        import torch  # only GPU profiles need the device count

        cuda_devices = torch.cuda.device_count()
    check_machine_can_serve(run_cfg.hw, cuda_devices)


def check_machine_can_serve(hw: HardwareProfile, cuda_device_count: int) -> None:
    """Fail fast when this machine cannot run ``hw`` for real (dry runs skip this check).

    ``cuda_device_count`` is passed in so the check stays a pure function of what the caller observed.
    """
    if hw.accelerator == "gpu" and cuda_device_count < hw.devices_per_node:
        raise ConfigError(
            "hw",
            f"hw={hw.name} needs {hw.devices_per_node} CUDA device(s) per node but this machine has "
            f"{cuda_device_count}",
            "run on a machine that has them, use hw=cpu to train here, or add dry_run=true to only validate "
            "and print what would launch",
        )
    if hw.num_nodes > 1 and not process_role().cluster:
        raise ConfigError(
            "hw.num_nodes",
            f"hw={hw.name} spans {hw.num_nodes} nodes but this process was not started by a cluster launcher "
            "(no SLURM/torchrun environment)",
            "launch through SLURM (hydra/launcher=slurm) or torchrun on every node, or add dry_run=true",
        )
    if hw.accelerator == "cpu":
        cores = os.cpu_count() or 1
        if hw.devices_per_node > 4 * cores:
            raise ConfigError(
                "hw.devices_per_node",
                f"{hw.devices_per_node} CPU processes on {cores} core(s) would thrash this machine",
                f"use at most {4 * cores} (hw.devices_per_node={min(2, cores)} is the default)",
            )
