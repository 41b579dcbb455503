"""One training run, from a composed Hydra config to the summary line.

Order matters: everything that can be wrong with the user's input is checked before a process is spawned or a
file is written (``prepare``, once per process, and the launch check); only then does the ``Job`` (job.py) run its
phases: spawn the local ranks, build, record, fit, finish. A dry run, and a launch that supervises restarts, end
here instead.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from omegaconf import DictConfig

from diagnostics.collect.profile_window import release_cupti_after_window
from disttrain.checkpoint.space import check_checkpoint_space, checkpoint_space
from disttrain.config.errors import ConfigError
from disttrain.config.hf import reference_shape
from disttrain.config.schema import CustomDataConfig, CustomModelConfig, LightningModuleConfig, token_seq_len
from disttrain.config.strategy_schema import FSDPConfig
from disttrain.data.user_datamodule import check_user_datamodule, describe_batch_size
from disttrain.job.describe import describe_launch
from disttrain.job.job import Job
from disttrain.job.launcher import Launcher, LaunchKind
from disttrain.job.prepare import Prepared, check_launchable, prepare
from disttrain.launch.console import route_library_output_to_log_file
from disttrain.launch.env import ProcessRole, say
from disttrain.launch.exit_codes import RunStopped
from disttrain.models.factory import model_facts
from disttrain.models.facts import ModelFacts
from disttrain.models.user_module import check_manual_optimization, resolve_model_kind
from disttrain.planner.shapes import model_shape
from disttrain.reliability.preemption import keep_previous_metrics, slurm_attempt
from disttrain.strategies.auto import check_fits, describe_memory, predict_memory
from disttrain.strategies.fsdp_user import wrap_classes
from disttrain.sweep.objective import objective_value
from disttrain.training.footprint import measure_footprint


def run_from_hydra(cfg: DictConfig, launcher: Launcher) -> float | None:
    """Run the job; returns its objective (``objective=``, for a Hydra sweeper) where this process can read it.

    ``launcher``: this process's part in the launch (launcher.py), with what preflight prepared and checked here
    (``checked``; None: prepare here)."""
    started = time.time()
    run_dir, task_overrides, role = launcher.run_dir, launcher.task_overrides, launcher.role
    launcher.watch_own_launcher()
    route_library_output_to_log_file()
    release_cupti_after_window()  # before anything in this process can initialise Kineto
    prepared = launcher.checked
    if prepared is None:  # a process preflight did not see: a local rank, a restart attempt, a multirun job
        prepared = prepare(cfg, run_dir, task_overrides)
        check_launchable(prepared)
    else:  # preflight checked the command and claimed the run dir (claim.py): no other launch writes here
        prepared = prepared.with_hydra_config(cfg)
    # A user's model and datamodule are checked here, not in preflight: importing them imports torch, and the
    # launcher forks its CPU ranks only if torch was not imported before (launch/fork.py); a new interpreter per
    # rank costs a short run seconds. facts: a user model's factory called on meta, its logits' shape checked.
    prepared = with_user_model_resolved(prepared)
    run_cfg = prepared.run_cfg
    facts = model_facts(run_cfg.model, run_cfg.trainer.seed)
    micro = prepared.parallel.batch.micro_batch_size
    if isinstance(run_cfg.data, CustomDataConfig):
        check_user_datamodule(run_cfg.data, micro, token_seq_len(run_cfg.model))
    manual_note = check_manual_optimization(facts, prepared.parallel.batch.accumulation, run_cfg.trainer.grad_clip)
    if isinstance(run_cfg.model, LightningModuleConfig) and isinstance(run_cfg.strategy, FSDPConfig):
        wrap_classes(run_cfg.strategy)  # a class path that does not import: one line now, not on every rank
    if role.is_global_zero:
        prepared = with_module_states(prepared)
        if not run_cfg.dry_run:  # a dry run warns instead (below)
            check_fits(run_cfg, prepared.memory, run_cfg.check_memory)
            check_room_for_checkpoints(prepared, run_dir)  # this machine's disk: not a dry run's (it may run elsewhere)
        announce(prepared, facts)
        if manual_note:
            say(manual_note)
    if run_cfg.dry_run:
        if role.is_global_zero:
            try:
                check_fits(run_cfg, prepared.memory, run_cfg.check_memory)
            except ConfigError as err:  # a dry run launches nothing: warn about what a real launch would refuse
                say(f"warning: a real launch would be refused: {err}")
            say("dry run: configuration is valid; nothing was launched")
        return None
    if launcher.kind(prepared) is LaunchKind.SUPERVISOR:
        # Restarts need a process that is not itself a rank: this one becomes the supervisor (supervise.py).
        code = launcher.supervise(run_cfg.trainer.max_restarts)
        if code:
            raise RunStopped(code)
        return objective_value(run_dir, run_cfg.objective)  # the attempts wrote run.json
    if role.is_global_zero:
        announce_attempt(prepared, role, run_dir)
    job = Job(prepared, facts, run_dir, role, started, launcher)
    world = {"world_size": prepared.parallel.world_size, "global_batch": prepared.parallel.batch.global_batch_size,
             "accumulation": prepared.parallel.batch.accumulation}  # fmt: skip
    with slurm_attempt(run_dir, role.is_global_zero, prepared.checkpoint, world):  # under SLURM: rendezvous, requeue
        job.run()
    return objective_value(run_dir, run_cfg.objective) if role.is_global_zero else None


def with_user_model_resolved(prepared: Prepared) -> Prepared:
    """``prepared`` with a ``model._target_`` imported and told apart: a LightningModule or a token model
    (models/user_module.py); any other model as it is."""
    model = prepared.run_cfg.model
    if not isinstance(model, CustomModelConfig | LightningModuleConfig):
        return prepared
    resolved = resolve_model_kind(model)
    if resolved is model:
        return prepared
    return dataclasses.replace(prepared, run_cfg=dataclasses.replace(prepared.run_cfg, model=resolved))


def with_module_states(prepared: Prepared) -> Prepared:
    """A LightningModule's parameters, gradients and optimizer states measured on meta (training/footprint.py), and
    the memory they predict per device: the memory line, the launch's memory check and run.json's prediction take
    them. Its activations are not measured here: that needs a batch, and the datamodule is not built twice (the
    run builds it; ``python -m plan`` measures them)."""
    model = prepared.run_cfg.model
    if not isinstance(model, LightningModuleConfig) or prepared.parallel.mesh is None:
        return prepared
    footprint = measure_footprint(model, None, prepared.parallel.batch.micro_batch_size)
    measured = dataclasses.replace(prepared, footprint=footprint)
    return dataclasses.replace(
        measured, memory=predict_memory(measured.run_cfg, measured.parallel, measured.planner_shape)
    )


def check_room_for_checkpoints(prepared: Prepared, run_dir: Path) -> None:
    """The run's checkpoints against the free space under its run dir (checkpoint/space.py), for any model whose
    parameters are known before it is built: the planner's shape of the built-in and HF models, a LightningModule's
    measured one."""
    shape = prepared.planner_shape
    if shape is None:
        reference = reference_shape(prepared.run_cfg.model)
        shape = model_shape(reference) if reference is not None else None
    if shape is not None:
        check_checkpoint_space(checkpoint_space(shape, prepared.run_cfg.trainer, Path(run_dir) / "checkpoints"))


def announce(prepared: Prepared, facts: ModelFacts) -> None:
    """The launch lines: layout, batch and model, then what prepare decided for the user (warmup, elastic world,
    the auto strategy's pick) and the predicted memory."""
    run_cfg = prepared.run_cfg
    say(describe_launch(run_cfg, prepared.parallel, facts))
    if isinstance(run_cfg.model, LightningModuleConfig) and isinstance(run_cfg.data, CustomDataConfig):
        say(describe_batch_size(run_cfg.data, prepared.parallel.batch.micro_batch_size))
    for note in (prepared.warmup_note, prepared.elastic_note, prepared.auto_reason):
        if note:
            say(note)
    if prepared.memory is not None:
        states_only = "; activations not included (python -m plan measures them)" if prepared.footprint else ""
        say(describe_memory(run_cfg, prepared.memory) + states_only)


def announce_attempt(prepared: Prepared, role: ProcessRole, run_dir: Path) -> None:
    """Rank 0 of an attempt that trains: where it resumes from, and a restart keeps the earlier metrics."""
    run_cfg = prepared.run_cfg
    if run_cfg.trainer.max_restarts and role.cluster and not role.supervised:
        say(
            "note: trainer.max_restarts applies to local launches; under torchrun use --max-restarts (a restarted "
            "job resumes from its run dir's newest complete checkpoint when hydra.run.dir is fixed)"
        )
    if prepared.resume is not None:
        say((f"restart {prepared.attempt}: " if prepared.attempt else "") + prepared.resume.describe())
        if run_cfg.resume_weights_only:
            say(
                "resume_weights_only=true: model weights, step, schedule and data position resumed; the optimizer "
                "state (Adam's moments and step counts) starts afresh"
            )
    if prepared.attempt:
        keep_previous_metrics(run_dir, prepared.attempt)  # a restart trains in the same run dir


__all__ = ["ConfigError", "run_from_hydra"]
