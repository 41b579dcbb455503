"""One training run, from a composed Hydra config to the summary line.

Order matters: everything that can be wrong with the user's input is checked before a process is spawned
or a file is written (``prepare``, once per process, and the launch check); only then does ``train`` spawn the
local ranks, fit (build, record the run, ``Trainer.fit``) and finish (run.json, the summary, the report).
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
import traceback
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from diagnostics.calibration import Calibration, write_calibration
from diagnostics.collect.profile_window import release_cupti_after_window
from diagnostics.crash import is_peer_failure, retire_crash_records
from diagnostics.manifest import RunManifest, read_manifest
from diagnostics.prediction import one_line
from disttrain.checkpoint.resume import newest_complete
from disttrain.config.errors import ConfigError
from disttrain.config.schema import HFDataConfig, HFModelConfig, RunConfig
from disttrain.config.validate import BatchPlan, WorldLayout
from disttrain.job.describe import RunResult, describe_launch, describe_result
from disttrain.job.early_start import take_started_ranks
from disttrain.job.failure import (
    FailureReporting,
    interrupting_signal,
    log_to_own_file,
    rank_died,
    record_crash,
    record_hang,
    stop_for_failure,
    stop_for_signal,
)
from disttrain.job.launcher_death import report_launcher_death, stop_watching, watch_this_process
from disttrain.job.manifest import command_line, git_commit, versions
from disttrain.job.objective import objective_value
from disttrain.job.prediction import predict_run, with_measurement
from disttrain.job.prepare import Prepared, check_launchable, prepare
from disttrain.job.redaction import redact, redact_yaml_files
from disttrain.launch.console import route_library_output_to_log_file
from disttrain.launch.env import process_role, say
from disttrain.launch.exit_codes import FAILED, NONFINITE, RunStopped
from disttrain.launch.local import (
    LocalRanks,
    await_parent_death,
    child_command,
    die_with_parent,
    spawn_local_ranks,
)
from disttrain.launch.supervise import supervise
from disttrain.models.factory import ModelFacts, model_facts
from disttrain.reliability.nan_guard import agreed_stop, retire_stop_markers, write_stop_marker
from disttrain.reliability.preemption import keep_previous_metrics, slurm_attempt
from disttrain.reliability.sigterm import signalled_rank
from disttrain.strategies.auto import check_fits, describe_memory

# How long a spawned rank whose peer connection broke waits for rank 0's exit to be seen before it gives up: under
# load a SIGKILLed rank 0 can take seconds to finish exiting. Costs nothing when the lost peer was another rank
# (rank 0 then ends this rank itself, at once).
PEER_LOSS_WAIT_S = 15.0

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from diagnostics.report import Report
    from disttrain.training.build import TrainerParts


def run_from_hydra(cfg: DictConfig, module_name: str, prepared: Prepared | None = None) -> float | None:
    """Run the job; returns its objective (``objective=``, for a Hydra sweeper) where this process can read it.

    ``prepared``: what ``preflight`` prepared and checked in this process (None: prepare here)."""
    started = time.time()
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    task_overrides = list(hydra_cfg.overrides.task)
    # A spawned rank or restart attempt must not outlive the process that started it. A rank spawned by an
    # unsupervised rank 0 also records rank 0's death (nobody else can); under the supervisor, the supervisor does.
    role = process_role()
    die_with_parent(partial(report_launcher_death, run_dir) if role.child and not role.supervised else None)
    route_library_output_to_log_file()
    release_cupti_after_window()  # before anything in this process can initialise Kineto
    if prepared is None:  # a process preflight did not see: a local rank, a restart attempt, a multirun job
        prepared = prepare(cfg, run_dir, task_overrides)
        check_launchable(prepared)
    else:  # preflight checked the command and claimed the run dir (claim.py): no other launch writes here
        prepared = prepared.with_hydra_config(cfg)
    cfg, run_cfg, layout, plan, auto_reason = (
        prepared.cfg,
        prepared.run_cfg,
        prepared.layout,
        prepared.plan,
        prepared.auto_reason,
    )
    checkpoint = prepared.resume.checkpoint if prepared.resume is not None else None
    memory = prepared.memory

    facts = model_facts(run_cfg.model, run_cfg.trainer.seed)
    rank_zero = process_role().is_global_zero
    if rank_zero:
        say(describe_launch(run_cfg, layout, plan, facts.num_parameters, facts.flops_per_token))
        if prepared.warmup_note:
            say(prepared.warmup_note)
        if prepared.elastic_note:
            say(prepared.elastic_note)
        if auto_reason:
            say(auto_reason)
        if memory is not None:
            say(describe_memory(run_cfg, memory))
    if run_cfg.dry_run:
        if rank_zero:
            try:
                check_fits(run_cfg, memory, run_cfg.check_memory)
            except ConfigError as err:  # a dry run launches nothing: warn about what a real launch would refuse
                say(f"warning: a real launch would be refused: {err}")
            say("dry run: configuration is valid; nothing was launched")
        return None
    restarts = run_cfg.trainer.max_restarts
    if restarts and process_role().starts_the_job:
        # Restarts need a process that is not itself a rank: this one becomes the supervisor (supervise.py).
        code = supervise(module_name, task_overrides, run_dir, restarts, os.getcwd())
        if code:
            raise RunStopped(code)
        return objective_value(run_dir, run_cfg.objective)  # the attempts wrote run.json
    if rank_zero and restarts and process_role().cluster and not process_role().supervised:
        say(
            "note: trainer.max_restarts applies to local launches; under torchrun use --max-restarts (a restarted "
            "job resumes from its run dir's newest complete checkpoint when hydra.run.dir is fixed)"
        )
    if rank_zero and prepared.resume is not None:
        prefix = f"restart {prepared.attempt}: " if prepared.attempt else ""
        say(prefix + prepared.resume.describe())
        if run_cfg.resume_weights_only:
            say(
                "resume_weights_only=true: model weights, step, schedule and data position resumed; the optimizer "
                "state (Adam's moments and step counts) starts afresh"
            )
    if rank_zero and prepared.attempt:
        keep_previous_metrics(run_dir, prepared.attempt)  # a restart trains in the same run dir
    command = partial(child_command, module_name, task_overrides, str(run_dir))
    world = {"world_size": layout.world_size, "global_batch": plan.global_batch_size, "accumulation": plan.accumulation}
    with slurm_attempt(run_dir, rank_zero, checkpoint, world):  # under SLURM: rendezvous, attempts record, requeue
        train(run_cfg, cfg, layout, plan, facts, run_dir, checkpoint, command, started, prepared.calibration)
    return objective_value(run_dir, run_cfg.objective) if rank_zero else None


def train(
    run_cfg: RunConfig,
    cfg: DictConfig,
    layout: WorldLayout,
    plan: BatchPlan,
    facts: ModelFacts,
    run_dir: Path,
    checkpoint: Path | None,
    command_for_rank: partial,
    started: float,
    calibration: Calibration | None = None,
) -> None:
    """This process's part of the job: spawn the local ranks (rank 0 of a local launch), fit, finish."""
    manifest = RunManifest()  # run.json's content once the run is built; a rank that dies marks it failed
    role = process_role()
    report = run_cfg.diagnostics.enabled and run_cfg.diagnostics.report
    failures = FailureReporting(run_dir, manifest, report, reports=not role.child and not role.cluster)
    early = take_started_ranks()  # started before torch was imported (early_start.py), or None
    if failures.reports and early is None:  # an early start is a new run dir, whose ranks may be writing already
        retire_crash_records(run_dir)  # a restart runs in the same run dir
        retire_stop_markers(run_dir)
    # A 1-process run has no rank to record its death (SIGKILL, the OOM killer): a torch-free process waits on it.
    alone = failures.reports and layout.world_size == 1 and not role.supervised
    watcher = watch_this_process(run_dir) if alone else None
    try:
        ranks = spawn(layout, command_for_rank, failures, early)
        parts, datamodule = fit(run_cfg, cfg, layout, plan, facts, run_dir, checkpoint, ranks, failures)
        finish(run_cfg, parts, datamodule, ranks, run_dir, manifest, started, (layout, plan, calibration))
    finally:
        stop_watching(watcher)  # the job ended by itself, and recorded how


def spawn(
    layout: WorldLayout, command_for_rank: partial, failures: FailureReporting, early: LocalRanks | None = None
) -> LocalRanks | None:
    """Local ranks 1..n-1 as children of this process, watched: one dying stops the job (None: nothing to spawn).
    ``early``: the ranks early_start.py already started for this job (this process then only joins as rank 0)."""
    role = process_role()
    if layout.world_size == 1 or role.child or role.cluster:
        return None
    if early is not None:
        early.become_rank_zero()
        ranks = early
    else:
        ranks = spawn_local_ranks(layout.devices_per_node, command_for_rank, cwd=os.getcwd())
    ranks.agreed_stop = partial(agreed_stop, failures.run_dir)  # a rank ending the agreed non-finite stop

    def abort(rank: int, code: int) -> None:
        # The survivors would wait forever in their next collective: stop the whole job now.
        if not failures.lock.acquire(blocking=False):
            return  # the main thread is already reporting this failure
        stop = stop_for_failure(failures, ranks, [(rank, code)], None)
        say(stop.message, file=sys.stderr)
        os._exit(stop.exit_code)

    ranks.watch(abort)
    return ranks


def fit(
    run_cfg: RunConfig,
    cfg: DictConfig,
    layout: WorldLayout,
    plan: BatchPlan,
    facts: ModelFacts,
    run_dir: Path,
    checkpoint: Path | None,
    ranks: LocalRanks | None,
    failures: FailureReporting,
) -> tuple[TrainerParts, pl.LightningDataModule]:
    """Build the run, record it (config.yaml, run.json) and fit; a dead local rank is named as the cause."""
    import lightning.pytorch as pl

    from disttrain.training.build import build_run

    local_processes = layout.devices_per_node
    threads = run_cfg.trainer.num_threads or max(1, (os.cpu_count() or 1) // local_processes)
    if run_cfg.hw.accelerator == "cpu":
        torch.set_num_threads(threads)
    pl.seed_everything(run_cfg.trainer.seed, workers=True, verbose=False)

    role = process_role()
    rank_zero = role.is_global_zero
    manifest = failures.manifest
    parts: TrainerParts | None = None
    try:
        parts, module, datamodule = build_run(run_cfg, layout, plan, run_dir, facts)
        if rank_zero and parts.diagnostics is not None and parts.diagnostics.on_hang is not None:
            # The watchdog of rank 0 names the hung rank in run.json, then writes the report that reads it.
            write_report = parts.diagnostics.on_hang
            parts.diagnostics.on_hang = lambda hang: (record_hang(failures, hang), write_report(hang))
        manifest.status = "running"
        # Credentials from the environment or in credential-named keys never reach a file (redaction.py).
        manifest.command = redact(command_line())
        manifest.config = redact(OmegaConf.to_container(cfg, resolve=True))
        manifest.hw, manifest.world, manifest.batch = run_cfg.hw, layout, plan
        manifest.num_parameters, manifest.flops_per_token = facts.num_parameters, facts.flops_per_token
        manifest.versions, manifest.git = versions(), git_commit()
        manifest.resumed_from = str(checkpoint) if checkpoint else None
        manifest.restart_attempt = process_role().attempt
        manifest.attempts = [*attempts_so_far(run_dir, process_role().attempt), this_attempt(layout, plan)]
        manifest.strategy_resolved = run_cfg.strategy
        if isinstance(run_cfg.data, HFDataConfig):
            from disttrain.data.hf import tokenizer_sha256

            manifest.tokenizer_sha256 = tokenizer_sha256(run_cfg.data.tokenizer)
        # The warmup the run uses (a default too long for max_steps was shortened by prepare).
        manifest.config["optimizer"]["warmup_steps"] = run_cfg.optimizer.warmup_steps
        if "compile" in manifest.config["model"]:  # null decided by the device and strategy (schema.py)
            manifest.config["model"]["compile"] = run_cfg.model.compile
        if rank_zero:
            (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(manifest.config)))
            redact_yaml_files([run_dir / ".hydra" / name for name in ("config.yaml", "overrides.yaml", "hydra.yaml")])
            manifest.write(run_dir)
        # weights_only: a checkpoint is data, never code (rng.py keeps the RNG states loadable this way).
        ckpt_path = str(checkpoint) if checkpoint else None
        parts.trainer.strategy.resume_weights_only = run_cfg.resume_weights_only  # type: ignore[attr-defined]
        parts.trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        if ranks is not None:
            # Past the last collective a rank ending (even non-zero: a non-finite stop) cannot hang the others.
            ranks.stop_watching()
    except BaseException as err:
        crashed = isinstance(err, Exception) and not isinstance(err, ConfigError | RunStopped)
        if crashed:
            record_crash(run_dir, err, parts)
        if crashed and role.child:
            # The launcher prints the error of the rank that caused the failure, once: this one's goes to its log.
            log_to_own_file(run_dir, "".join(traceback.format_exception(err)))
            # The lost peer may be rank 0: its death is recorded first. An error not known as a peer's loss still
            # waits a moment, so that no wording of a lost connection leaves rank 0's death unrecorded.
            await_parent_death(timeout_s=PEER_LOSS_WAIT_S if is_peer_failure(type(err).__name__, str(err)) else 1.0)
            raise RunStopped(FAILED) from None
        if crashed and failures.reports:
            failures.lock.acquire()  # if the rank watcher holds it, it is ending this process
            raise stop_for_failure(failures, ranks, None, err) from None
        if ranks is None and failures.reports and (signum := interrupting_signal(err)) is not None:
            raise stop_for_signal(failures, signum) from None  # else SIGTERM would exit 0 with run.json "running"
        signalled = signalled_rank(parts.nonfinite.riders) if parts is not None and parts.nonfinite else None
        if (
            ranks is not None
            and failures.reports
            and signalled is not None
            and interrupting_signal(err) == signal.SIGTERM
        ):
            ranks.wait()  # every rank agreed in the same vote and stops after the same batch
            raise stop_for_signal(failures, signal.SIGTERM, signalled) from None
        if ranks is None:
            raise
        # A rank that died makes rank 0's next collective fail at once ("connection reset"): name the cause.
        dead = [] if isinstance(err, KeyboardInterrupt) else ranks.dead(wait_s=3.0)
        ranks.kill()
        if not dead:
            raise
        message = rank_died(run_dir, manifest, *dead[0])
        if dead[0][1] > 0:  # it raised an exception of its own (printed above): rank 0's may be the same bug
            say(message, file=sys.stderr)
            raise
        seen = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
        raise RunStopped(1, f"{message} (rank 0 then failed with {seen})") from None
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Frees what DDP holds; FSDP2/DTensor groups outlive this (C++ hook cycles), see process_exit.py.
            torch.distributed.destroy_process_group()
    return parts, datamodule


def finish(
    run_cfg: RunConfig,
    parts: TrainerParts,
    datamodule: pl.LightningDataModule,
    ranks: LocalRanks | None,
    run_dir: Path,
    manifest: RunManifest,
    started: float,
    planned: tuple[WorldLayout, BatchPlan, Calibration | None],
) -> None:
    """Wait for the local ranks; on rank 0 complete run.json, print the summary and write the report."""
    rank_zero = process_role().is_global_zero
    guard = parts.nonfinite
    stopped = guard is not None and guard.stopped
    failed = ranks.wait() if ranks is not None else []
    if failed and not (stopped and all(code == NONFINITE for _, code in failed)):
        raise RuntimeError(f"local ranks exited with errors: {failed}")
    if not rank_zero:
        if stopped:
            # Before the exit: the launcher may see it before its own stop path is done (nan_guard.py).
            write_stop_marker(run_dir, process_role().global_rank, guard.stop_reason)
            raise RunStopped(NONFINITE)
        return
    try:
        prediction = predict_and_measure(run_cfg, parts, run_dir, planned)
    except Exception as err:  # a layout the planner cannot model must not turn a finished run into a failure
        say(f"disttrain: no planner prediction for this run: {type(err).__name__}: {err}", file=sys.stderr)
        prediction = None
    predicted_memory_bytes = prediction["predicted"]["memory_bytes"] if prediction else None
    metrics = parts.trainer.callback_metrics
    floor = getattr(datamodule, "loss_floor", None)
    result = RunResult(
        steps=parts.trainer.global_step,
        wall_time_s=time.time() - started,
        train_loss=float(metrics["train/loss"]) if "train/loss" in metrics else None,
        val_loss=float(metrics["val/loss"]) if "val/loss" in metrics else None,
        loss_floor=floor.window_floor if floor else None,
        entropy_rate=floor.entropy_rate if floor else None,
        tokens_per_s=parts.throughput.tokens_per_s,
        run_dir=str(run_dir),
        step_time_p50_s=parts.throughput.step_time_p50_s,
        predicted_memory_bytes=predicted_memory_bytes,
        measured_memory_bytes=measured_peak_memory(),
        memory_kind="peak RSS" if run_cfg.hw.accelerator == "cpu" else "peak allocated",
    )
    pruned = parts.pruning.pruned_at if parts.pruning is not None else None
    manifest.status = "stopped" if stopped else "pruned" if pruned is not None else "completed"
    if pruned is not None:  # the sweep's pruner stopped it at this validation: a clean end, reported as usual
        manifest.pruned_at_step = pruned
        say(f"disttrain: pruned at step {pruned}: the study's pruner judged this trial's validation loss hopeless")
    manifest.wall_time_s, manifest.result = result.wall_time_s, result
    manifest.result_gap_to_floor = result.gap_to_floor
    # No checkpoint is written for the bad step, so the newest complete one is the last good one.
    last = newest_complete(parts.ckpt_dir) if stopped else None
    if guard is not None:
        manifest.nonfinite = {
            "policy": guard.policy,
            "skipped_steps": guard.skipped_steps,
            "scaler_skipped_steps": guard.scaler_skipped_steps,
            "stopped_at_step": guard.stopped_at,
            "stop_reason": guard.stop_reason,
        }
        if stopped:  # the report names it (diagnostics/analysis/detect_nonfinite.py)
            manifest.nonfinite["last_good_checkpoint"] = str(last.checkpoint) if last else None
    exported = maybe_export_hf(run_cfg, parts.ckpt_dir, run_dir) if not stopped else None
    manifest.hf_export = str(exported) if exported is not None else None
    manifest.prediction = prediction
    manifest.write(run_dir)
    say(describe_result(result))
    if exported is not None:
        say(f"  hf model    {exported} (transformers from_pretrained)")
    if guard is not None and guard.skipped_steps:
        say(f"  skipped     {len(guard.skipped_steps)} step(s) with non-finite loss/gradients: {guard.skipped_steps}")
    if run_cfg.diagnostics.enabled and run_cfg.diagnostics.report:
        report = say_report(run_dir, parts.trainer)
        if report is not None and report.prediction is not None:  # the telemetry measured more (comm, every rank)
            manifest.prediction = report.prediction
            manifest.write(run_dir)
    elif prediction is not None:
        say(f"  {one_line(prediction)}")
    if stopped:
        kept = f"; last good checkpoint: {last.checkpoint}" if last else "; no checkpoint was saved before it"
        raise RunStopped(NONFINITE, f"disttrain: stopped: {guard.stop_reason}{kept}")


def this_attempt(layout: WorldLayout, plan: BatchPlan) -> dict[str, int]:
    return {
        "attempt": process_role().attempt,
        "world_size": layout.world_size,
        "global_batch": plan.global_batch_size,
        "accumulation": plan.accumulation,
    }


def attempts_so_far(run_dir: Path, attempt: int) -> list[dict]:
    """The earlier attempts' records from run.json (a restart trains in the same run dir; an elastic one on
    another world size), so run.json lists every attempt's world size."""
    if attempt == 0:
        return []
    earlier, _ = read_manifest(run_dir)
    records = earlier.attempts if earlier is not None else []
    return [a for a in records if isinstance(a, dict) and a.get("attempt", attempt) < attempt]


def maybe_export_hf(run_cfg: RunConfig, ckpt_dir: Path, run_dir: Path) -> Path | None:
    """A model=hf run ends with its final weights in HF format under RUN_DIR/hf_model."""
    if not isinstance(run_cfg.model, HFModelConfig):
        return None
    last = newest_complete(ckpt_dir)
    if last is None:
        return None
    from disttrain.checkpoint.export import export_hf

    return export_hf(last.checkpoint, run_cfg.model, run_dir / "hf_model", run_cfg.trainer.seed)


def measured_peak_memory() -> int:
    """Peak bytes this rank used: GPU allocator peak on CUDA, else the process's peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def predict_and_measure(
    run_cfg: RunConfig, parts: TrainerParts, run_dir: Path, planned: tuple[WorldLayout, BatchPlan, Calibration | None]
) -> dict | None:
    """The planner's prediction for this run (with this run's own start-up calibration, else ``calibration=``,
    else datasheet numbers) beside what rank 0 measured; writes RUN_DIR/calibration.json when it measured any."""
    layout, plan, given = planned
    own = write_calibration(run_dir) if run_cfg.diagnostics.enabled and run_cfg.diagnostics.calibrate else None
    record = predict_run(run_cfg, layout, plan, own or given)
    if record is None:
        return None
    measured: dict = {}
    tokens_per_step = plan.global_batch_size * run_cfg.model.seq_len
    # The median step, as the telemetry's figure is (the report replaces this one): a whole-run mean carries
    # every burst of other work on a shared machine.
    step_time_s = parts.throughput.step_time_p50_s
    if step_time_s is None and parts.throughput.tokens_per_s:
        step_time_s = tokens_per_step / parts.throughput.tokens_per_s
    if step_time_s:
        tokens_per_s = tokens_per_step / step_time_s
        measured.update(tokens_per_s=tokens_per_s, step_time_s=step_time_s)
        predicted = record["predicted"]
        if predicted.get("mfu") and predicted.get("tokens_per_s"):
            measured["mfu"] = predicted["mfu"] * tokens_per_s / predicted["tokens_per_s"]
    if parts.diagnostics is not None and parts.diagnostics.training_state:
        measured["state_bytes"] = parts.diagnostics.training_state  # rank 0's; the report takes every rank's
    if run_cfg.hw.accelerator == "gpu":
        measured["memory_bytes"] = measured_peak_memory()
    return with_measurement(record, measured)


def say_report(run_dir: Path, trainer: object | None = None, quiet: bool = False) -> Report | None:
    """The bottleneck report, after every rank has finished writing telemetry, through the function that
    ``python -m diagnose`` uses; prints its summary unless ``quiet``, and attaches it to the ``trainer``'s loggers
    that can hold it (wandb, TensorBoard). Never fails the run."""
    from diagnostics.report import diagnose_run
    from disttrain.training.logger_text import attach_report

    try:
        report = diagnose_run(run_dir)
        if not quiet:
            say(report.text_summary())
        if trainer is not None:
            attached = attach_report(trainer.loggers, run_dir, trainer.global_step)  # type: ignore[attr-defined]
            if attached:
                say(f"  the report is attached to the {' and the '.join(attached)}")
        return report
    except Exception as err:  # a broken report must not turn a finished training run into a failure
        say(f"disttrain: could not write the diagnostics report: {type(err).__name__}: {err}", file=sys.stderr)
        return None


__all__ = ["ConfigError", "run_from_hydra"]
