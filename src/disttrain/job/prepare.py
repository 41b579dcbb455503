"""One job, checked and resolved before anything is spawned: ``prepare`` and the launch check.

``prepare`` reads top to bottom: guard the run dir, find the resume point (re-composing the resumed run's
config), parse the typed config, validate it, resolve ``strategy=auto``, check the world the launcher started and
the checkpoint's shapes, predict memory. It runs once per process: ``preflight`` (before Hydra) passes its result
on to ``run_from_hydra`` in the same process; local ranks, restart attempts and cluster tasks run it themselves.
``check_launchable`` is the one launch check (memory, devices, nodes) of both paths.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from diagnostics.calibration import Calibration
from diagnostics.manifest import read_manifest
from disttrain.checkpoint.compat import check_same_tokenizer, check_strategy_can_read
from disttrain.checkpoint.resume import ResumePoint, find_resume_point, newest_complete, original_overrides, run_dir_of
from disttrain.config.calibration import load_calibration
from disttrain.config.errors import ConfigError
from disttrain.config.hardware import HardwareProfile
from disttrain.config.parse import parse_run_config
from disttrain.config.schema import HFDataConfig, LightningModuleConfig, RunConfig, with_compile_decided
from disttrain.config.strategy_schema import AutoStrategyConfig
from disttrain.config.validate import BatchPlan, WorldLayout
from disttrain.data.corpus_check import tokenize_corpus
from disttrain.data.hf import tokenizer_sha256
from disttrain.job.claim import RUN_MARKERS, holder, refuse_taken
from disttrain.launch.env import process_role
from disttrain.planner import MemoryBreakdown, ModelShape
from disttrain.planner.footprint import ModuleFootprint, footprint_shape
from disttrain.strategies.auto import check_fits, predict_memory, resolve_auto
from disttrain.strategies.layout import ParallelLayout, parallel_layout, world_layout


@dataclass(frozen=True)
class Prepared:
    """A validated job: the config it runs with (re-composed on resume), where it resumes from, what it needs."""

    cfg: DictConfig
    run_cfg: RunConfig
    parallel: ParallelLayout  # world, batch plan and mesh degrees, derived once (strategies/layout.py)
    auto_reason: str | None
    resume: ResumePoint | None
    attempt: int
    memory: MemoryBreakdown | None  # predicted per device; None for a user model the planner cannot see into
    warmup_note: str | None = None  # said at launch when the default warmup was shortened to fit max_steps
    calibration: Calibration | None = None  # calibration=RUN_DIR: measured speeds for auto and the prediction
    elastic_note: str | None = None  # said at launch when a restart found another world size and adapted to it
    # A LightningModule's parameters, gradients and optimizer states measured on meta (rank 0, job/run.py): the
    # planner's shape of it for the memory check and run.json's prediction.
    footprint: ModuleFootprint | None = None

    @property
    def planner_shape(self) -> ModelShape | None:
        """The measured module's shape for the planner (None: the planner reads the model's own config)."""
        model = self.run_cfg.model
        if self.footprint is None or not isinstance(model, LightningModuleConfig):
            return None
        return footprint_shape(model.target, self.footprint)

    @property
    def checkpoint(self) -> Path | None:
        """The checkpoint the run resumes from (None: a fresh start)."""
        return self.resume.checkpoint if self.resume is not None else None

    def resolved_config(self) -> dict:
        """The composed config as plain data, interpolations resolved (what run.json and config.yaml record): below
        prepare nothing handles the DictConfig itself."""
        return OmegaConf.to_container(self.cfg, resolve=True)  # type: ignore[return-value]

    def with_hydra_config(self, cfg: DictConfig) -> Prepared:
        """This job as the Hydra app composed it: preflight's config carried Hydra's own node (and a resumed
        run's config is the re-composed one either way)."""
        return self if self.resume is not None else dataclasses.replace(self, cfg=cfg)


def refuse_optimizer_overrides(overrides: list[str]) -> None:
    """A LightningModule builds its optimizer in ``configure_optimizers``: an ``optimizer`` override would change
    nothing, silently."""
    for item in overrides:
        key = item.lstrip("+~").split("=", 1)[0]
        if key == "optimizer" or key.startswith("optimizer."):
            raise ConfigError(
                key,
                "does not reach a LightningModule: its configure_optimizers builds the optimizer and schedule",
                "pass the value to your module instead (e.g. +model.lr=1e-3 for an lr argument), and drop it",
            )


def fit_default_warmup(run_cfg: RunConfig, overrides: list[str]) -> tuple[RunConfig, str | None]:
    """``python -m train trainer.max_steps=10`` is the first thing people try: a default warmup longer than the
    run is shortened to a tenth of it (1-bit Adam's default freeze to a fifth: the paper's 15-25%), and said. A
    value the user set on the command line is theirs (validation still refuses one that does not fit)."""
    o, steps = run_cfg.optimizer, run_cfg.trainer.max_steps
    if isinstance(run_cfg.model, LightningModuleConfig):  # its optimizer and schedule are its own
        refuse_optimizer_overrides(overrides)
        return run_cfg, None
    fitted: dict[str, Any] = {}
    notes: list[str] = []
    for key, current, share, applies in (
        ("warmup_steps", o.warmup_steps, 10, True),
        ("freeze_steps", o.freeze_steps, 5, o.name == "onebit_adam"),
    ):
        explicit = any(item.lstrip("+~").startswith(f"optimizer.{key}=") for item in overrides)
        if not applies or explicit or current < steps or steps < 1:
            continue
        fitted[key] = max(1, steps // share) if key == "freeze_steps" else steps // share
        notes.append(
            f"optimizer.{key}: the default {current} does not fit trainer.max_steps={steps}; using {fitted[key]} "
            f"(set optimizer.{key} to choose)"
        )
    if not fitted:
        return run_cfg, None
    return dataclasses.replace(run_cfg, optimizer=dataclasses.replace(o, **fitted)), "; ".join(notes)


def module_states_shape(
    run_cfg: RunConfig, parallel: ParallelLayout, calibration: Calibration | None
) -> ModelShape | None:
    """A user's LightningModule, for strategy=auto: its parameters and optimizer states measured on meta (every rank
    measures the same, so every rank picks the same layout). Only where auto times layouts at all (a peak FLOP/s,
    from the hw profile or a calibration): measuring imports the module and torch before this process starts its
    ranks, which then start as new interpreters (launch/fork.py)."""
    model = run_cfg.model
    if not isinstance(model, LightningModuleConfig):
        return None
    if run_cfg.hw.peak_flops(run_cfg.precision.compute_dtype) is None and calibration is None:
        return None
    from disttrain.training.footprint import measure_footprint  # torch, for this case only

    return footprint_shape(model.target, measure_footprint(model, None, parallel.batch.micro_batch_size))


def resolve_strategy(
    run_cfg: RunConfig, parallel: ParallelLayout, calibration: Calibration | None = None
) -> tuple[RunConfig, ParallelLayout, str | None]:
    """``strategy=auto`` replaced by the layout the planner picks, validated again as that strategy."""
    if not isinstance(run_cfg.strategy, AutoStrategyConfig):
        return run_cfg, parallel, None
    run_cfg, reason = resolve_auto(run_cfg, parallel, calibration, module_states_shape(run_cfg, parallel, calibration))
    run_cfg = with_compile_decided(run_cfg)
    return run_cfg, parallel_layout(run_cfg), reason


def _override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def dropped_by_new_choices(original: list[str], task_overrides: list[str]) -> list[str]:
    """The original run's overrides minus a config group this command chooses differently (choice and options).

    ``resume=<deepspeed run with strategy.stage=2> strategy=fsdp`` resumes under FSDP: the DeepSpeed option would not
    compose with it (and belongs to the strategy given up), so a re-chosen group takes the new choice's options."""
    before = {_override_key(o): o for o in original if "." not in _override_key(o)}
    changed = {
        _override_key(o) for o in task_overrides if "." not in _override_key(o) and before.get(_override_key(o)) != o
    }
    return [o for o in original if _override_key(o).split(".", 1)[0] not in changed]


def _is_resume(override: str) -> bool:
    return _override_key(override) == "resume"


def recorded_overrides(resume: str, seen: frozenset[Path] = frozenset()) -> list[str]:
    """The overrides that made the run ``resume`` points into, through any chain of resumes.

    A resumed run records only its own command (``resume=<earlier run> strategy=fsdp``): the earlier run's recorded
    overrides come first, the later command's options replacing what it re-chose."""
    own = original_overrides(resume)
    parent = next((o.split("=", 1)[1] for o in own if _is_resume(o)), None)
    own = [o for o in own if not _is_resume(o)]
    here = run_dir_of(Path(resume).expanduser()).resolve()
    if parent is None or here in seen or not Path(parent).expanduser().exists():
        return own
    return dropped_by_new_choices(recorded_overrides(parent, seen | {here}), own) + own


def compose_for_resume(resume: str, task_overrides: list[str]) -> DictConfig:
    """The resumed run's config: its original overrides, then this command's (later ones win)."""
    keep = dropped_by_new_choices(recorded_overrides(resume), task_overrides) + task_overrides
    keep = [o for o in keep if not _is_resume(o)]
    try:
        return compose(config_name="train", overrides=[*keep, f"resume={resume}"])
    except HydraException as err:
        raise ConfigError(
            "resume",
            f"the run's recorded overrides plus this command's do not compose ({str(err).splitlines()[0]})",
            f"check {run_dir_of(Path(resume))}/.hydra/overrides.yaml and the overrides given with resume=",
        ) from None


def existing_run(run_dir: Path) -> str | None:
    """What marks ``run_dir`` as taken (a launch's claim, its manifest or Hydra's record), or None."""
    return holder(run_dir, RUN_MARKERS)


def refuse_existing_run(run_dir: Path, marker: str) -> None:
    raise refuse_taken("hydra.run.dir", run_dir, marker)


def launched_by_cluster() -> int | None:
    """The world size a cluster launcher (torchrun, SLURM) started, or None (local ranks are ours to start)."""
    role = process_role()
    if role.child or role.launched_world_size is None:
        return None
    if not any(k in os.environ for k in ("SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "GROUP_RANK")):
        return None  # WORLD_SIZE without a cluster launcher is our own rank-0 environment (or a stale export)
    return role.launched_world_size


def launched_per_node(launched: int) -> int:
    """Processes per node as the launcher started them (torchrun's LOCAL_WORLD_SIZE, SLURM's tasks per node)."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0 and launched % int(value) == 0:
            return int(value)
    nodes = os.environ.get("SLURM_NNODES", "")
    if nodes.isdigit() and int(nodes) > 0 and launched % int(nodes) == 0:
        return launched // int(nodes)
    return launched


def fit_elastic_world(
    run_cfg: RunConfig, plan: BatchPlan, launched: int, per_node: int
) -> tuple[RunConfig, ParallelLayout, str]:
    """A restart (torchrun ``--nnodes=min:max``, a requeued SLURM job) that found ``launched`` ranks instead of the
    configured world: the same run on the new world, at the same global batch (the accumulation adapts), so its
    losses stay comparable and its checkpoint resumes exactly there (universal checkpoints)."""
    hw = dataclasses.replace(run_cfg.hw, num_nodes=launched // per_node, devices_per_node=per_node)
    dp = world_layout(dataclasses.replace(run_cfg, hw=hw)).data_parallel_size
    # More ranks: a smaller micro-batch (the largest that splits each rank's share), fewer: more accumulation.
    share = plan.global_batch_size // dp if plan.global_batch_size % dp == 0 else plan.micro_batch_size
    micro = max(m for m in range(1, min(share, plan.micro_batch_size) + 1) if share % m == 0)
    trainer = dataclasses.replace(run_cfg.trainer, global_batch_size=plan.global_batch_size, micro_batch_size=micro)
    adapted = dataclasses.replace(run_cfg, hw=hw, trainer=trainer)
    try:
        parallel = parallel_layout(adapted)
    except ConfigError as err:
        raise ConfigError(
            err.key,
            f"the restart found {launched} ranks instead of {run_cfg.hw.world_size} and cannot keep the global "
            f"batch of {plan.global_batch_size} on them ({err.problem})",
            err.fix,
        ) from None
    new_plan = parallel.batch
    note = (
        f"elastic restart: the launcher started {launched} ranks (the run had {run_cfg.hw.world_size}); training on "
        f"{hw.num_nodes} x {per_node} at the same global batch {new_plan.global_batch_size} = micro "
        f"{new_plan.micro_batch_size} x dp {new_plan.data_parallel_size} x accumulation {new_plan.accumulation}"
    )
    return adapted, parallel, note


def check_world_size(layout: WorldLayout) -> None:
    """Under torchrun/SLURM the launcher decides the process count: it must match what the config describes."""
    launched = launched_by_cluster()
    if launched is None:
        return
    if launched != layout.world_size:
        raise ConfigError(
            "hw.devices_per_node",
            f"the launcher started {launched} processes but the config describes hw.num_nodes x "
            f"hw.devices_per_node = {layout.num_nodes} x {layout.devices_per_node} = {layout.world_size}",
            f"set hw.num_nodes/hw.devices_per_node so their product is {launched}, or launch "
            f"{layout.world_size} processes",
        )


def guard_new_run_dir(run_dir: Path) -> None:
    """A job never writes over an earlier run. A launch through ``python -m train`` holds its dir by a claim
    (claim.py); this guards the jobs that are not claimed one by one: a multirun's (the launch claimed their sweep
    dir) and commands with Hydra flags, which preflight leaves to Hydra.

    Only a first attempt's global rank 0 guards: under SLURM/torchrun the other ranks may start after rank 0 wrote
    run.json, and a restart continues in its own run dir."""
    role = process_role()
    if role.attempt == 0 and role.is_global_zero and (run_dir / "run.json").exists():
        refuse_existing_run(run_dir, "run.json")


def find_resume(
    cfg: DictConfig, run_dir: Path | None, task_overrides: list[str], attempt: int
) -> tuple[DictConfig, ResumePoint | None]:
    """The config to run (``resume=``: the resumed run's, re-composed) and the checkpoint it continues from."""
    point: ResumePoint | None = None
    if cfg.get("resume"):
        point = find_resume_point(str(cfg.resume))
        cfg = compose_for_resume(str(cfg.resume), task_overrides)
    if attempt > 0 and run_dir is not None:
        # A restarted job continues from its own newest complete checkpoint (else from where it started).
        point = newest_complete(run_dir / "checkpoints") or point
    return cfg, point


def prepare(cfg: DictConfig, run_dir: Path | None, task_overrides: list[str]) -> Prepared:
    """All checks of one job before anything is spawned; ``run_dir`` None skips the run-dir guard."""
    attempt = process_role().attempt
    if run_dir is not None:
        guard_new_run_dir(run_dir)
    cfg, point = find_resume(cfg, run_dir, task_overrides, attempt)
    run_cfg, warmup_note = fit_default_warmup(parse_run_config(cfg), task_overrides)
    if point is not None and run_dir is not None and run_dir_of(point.checkpoint) == run_dir.resolve():
        # A restart continues its own run, whose optimizer state is this run's: resume_weights_only was for the start.
        run_cfg = dataclasses.replace(run_cfg, resume_weights_only=False)
    parallel = parallel_layout(run_cfg)
    tokenize_corpus(run_cfg)  # data=hf: once, before launch; the ranks then only map the cache
    calibration = load_calibration(run_cfg.calibration, run_cfg.hw)
    run_cfg, parallel, auto_reason = resolve_strategy(run_cfg, parallel, calibration)
    launched = launched_by_cluster()
    elastic_note = None
    if attempt > 0 and point is not None and launched is not None and launched != parallel.world_size:
        run_cfg, parallel, elastic_note = fit_elastic_world(
            run_cfg, parallel.batch, launched, launched_per_node(launched)
        )
    check_world_size(parallel.world)
    if point is not None:
        from disttrain.checkpoint.shapes import check_checkpoint_fits_model  # imports torch: only on resume

        check_checkpoint_fits_model(point.checkpoint, run_cfg.model, run_cfg.trainer.seed)
        check_strategy_can_read(point.checkpoint, run_cfg.strategy.name, parallel.world_size)
        check_resumed_tokenizer(point, run_cfg)
    memory = predict_memory(run_cfg, parallel)
    return Prepared(cfg, run_cfg, parallel, auto_reason, point, attempt, memory, warmup_note, calibration, elastic_note)


def check_resumed_tokenizer(point: ResumePoint, run_cfg: RunConfig) -> None:
    """data=hf: the tokenizer is the one the checkpoint's run recorded (the model's shapes cannot tell)."""
    if not isinstance(run_cfg.data, HFDataConfig):
        return
    recorded, _ = read_manifest(run_dir_of(point.checkpoint))
    if recorded is not None:
        current = tokenizer_sha256(run_cfg.data.tokenizer)
        check_same_tokenizer(recorded.tokenizer_sha256, run_cfg.data.tokenizer, current)


def check_launchable(prepared: Prepared, here: bool = True, memory: bool = True) -> None:
    """What a real launch refuses before spawning: the memory prediction (unless ``memory`` is False), and
    (``here``: this machine runs the job) devices or nodes it does not have. A dry run launches nothing and is
    refused nothing."""
    run_cfg = prepared.run_cfg
    if run_cfg.dry_run:
        return
    if memory:
        check_fits(run_cfg, prepared.memory, run_cfg.check_memory)
    if not here:
        return
    if run_cfg.precision.fp8:  # what this machine has installed, not what the config says
        from disttrain.models.fp8 import torchao_missing  # imports torch: only for fp8 runs

        missing = torchao_missing()
        if missing is not None:
            raise ConfigError("precision", f"fp8 training needs torchao: {missing}", "pip install torchao")
    cuda_devices = 0
    if run_cfg.hw.accelerator == "gpu":
        import torch  # only GPU profiles need the device count

        cuda_devices = torch.cuda.device_count()
        if run_cfg.precision.fp8 and cuda_devices:
            check_fp8_device(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
    check_machine_can_serve(run_cfg.hw, cuda_devices)


def check_fp8_device(name: str, capability: tuple[int, int]) -> None:
    """precision=fp8 on a GPU without fp8 tensor cores (before Ada/Hopper) would fail in the first matmul."""
    if tuple(capability) < (8, 9):
        raise ConfigError(
            "precision",
            f"fp8 needs compute capability 8.9+ (L4, H100, H200); this machine's {name} is "
            f"{capability[0]}.{capability[1]}",
            "use precision=bf16-mixed on this GPU",
        )


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
