"""One training run, from a composed Hydra config to the summary line.

Order matters: everything that can be wrong with the user's input is checked before a process is spawned
or a file is written; only then are local ranks started, the run recorded, and the Trainer fitted.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import resource
import sys
import threading
import time
import traceback
from functools import partial
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from diagnostics.crash import (
    describe_site,
    first_line,
    is_peer_failure,
    primary_crash,
    read_crash_records,
    retire_crash_records,
    write_crash_record,
)
from disttrain.build import ModelFacts, TrainerParts, model_facts
from disttrain.config.errors import ConfigError
from disttrain.config.schema import RunConfig
from disttrain.config.validate import BatchPlan, WorldLayout
from disttrain.describe import RunResult, describe_launch, describe_result
from disttrain.exit_codes import FAILED, NONFINITE, RunStopped
from disttrain.hardware import check_machine_can_serve, in_cluster_job
from disttrain.launch import (
    LocalRanks,
    child_command,
    describe_exit,
    die_with_parent,
    is_child_process,
    spawn_local_ranks,
)
from disttrain.manifest import command_line, git_commit, versions, write_json_atomic
from disttrain.planning import check_fits, describe_memory, predict_memory
from disttrain.preemption import keep_previous_metrics, slurm_attempt
from disttrain.preflight import prepare
from disttrain.redaction import redact, redact_yaml_files
from disttrain.resume import newest_complete
from disttrain.supervise import is_supervised, restart_attempt, supervise
from disttrain.sweeps import TRACEBACK_CHARS, global_rank, write_failure

say = functools.partial(print, flush=True)


def is_global_rank_zero() -> bool:
    if is_child_process():
        return False
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0


def run_from_hydra(cfg: DictConfig, module_name: str) -> None:
    started = time.time()
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    task_overrides = list(hydra_cfg.overrides.task)
    die_with_parent()  # a spawned rank or restart attempt must not outlive the process that started it
    prepared = prepare(cfg, run_dir, task_overrides)
    cfg, run_cfg, layout, plan, auto_reason = (
        prepared.cfg,
        prepared.run_cfg,
        prepared.layout,
        prepared.plan,
        prepared.auto_reason,
    )
    checkpoint = prepared.resume.checkpoint if prepared.resume is not None else None
    memory = predict_memory(run_cfg, layout, plan)

    facts = model_facts(run_cfg.model, run_cfg.trainer.seed)
    rank_zero = is_global_rank_zero()
    if rank_zero:
        say(describe_launch(run_cfg, layout, plan, facts.num_parameters, facts.flops_per_token))
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
        return
    check_fits(run_cfg, memory, run_cfg.check_memory)
    check_machine_can_serve(run_cfg.hw, torch.cuda.device_count())
    restarts = run_cfg.trainer.max_restarts
    if restarts and not is_child_process() and not is_supervised() and not in_cluster_job():
        # Restarts need a process that is not itself a rank: this one becomes the supervisor (supervise.py).
        code = supervise(module_name, task_overrides, run_dir, restarts, os.getcwd())
        if code:
            raise RunStopped(code)
        return
    if rank_zero and restarts and in_cluster_job() and not is_supervised():
        say(
            "note: trainer.max_restarts applies to local launches; under torchrun use --max-restarts (a restarted "
            "job resumes from its run dir's newest complete checkpoint when hydra.run.dir is fixed)"
        )
    if rank_zero and prepared.resume is not None:
        prefix = f"restart {prepared.attempt}: " if prepared.attempt else ""
        say(prefix + prepared.resume.describe())
    if rank_zero and prepared.attempt:
        keep_previous_metrics(run_dir, prepared.attempt)  # a restart trains in the same run dir
    command = partial(child_command, module_name, task_overrides, str(run_dir))
    predicted = None if memory is None else memory.total
    with slurm_attempt(run_dir, rank_zero, checkpoint):  # under SLURM: rendezvous, attempts record, requeue
        train(run_cfg, cfg, layout, plan, facts, run_dir, checkpoint, command, started, predicted)


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
    predicted_memory_bytes: int | None = None,
) -> None:
    import lightning.pytorch as pl

    from disttrain.build import build_run

    local_processes = layout.devices_per_node
    ranks = None
    parts: TrainerParts | None = None
    manifest: dict = {}
    report = run_cfg.diagnostics.enabled and run_cfg.diagnostics.report
    reporting = threading.Lock()  # one failure report per job: the main thread's or the rank watcher's
    reports_failures = not is_child_process() and not in_cluster_job()  # the launcher, or a 1-process run
    if reports_failures:
        retire_crash_records(run_dir)  # a restart runs in the same run dir
    if layout.world_size > 1 and not is_child_process() and not in_cluster_job():
        ranks = spawn_local_ranks(local_processes, command_for_rank, cwd=os.getcwd())

        def abort(rank: int, code: int) -> None:
            # The survivors would wait forever in their next collective: stop the whole job now.
            if not reporting.acquire(blocking=False):
                return  # the main thread is already reporting this failure
            stop = stop_for_failure(run_dir, manifest, ranks, [(rank, code)], None, report)
            say(stop.message, file=sys.stderr)
            os._exit(stop.exit_code)

        ranks.watch(abort)
    threads = run_cfg.trainer.num_threads or max(1, (os.cpu_count() or 1) // local_processes)
    if run_cfg.hw.accelerator == "cpu":
        torch.set_num_threads(threads)
    pl.seed_everything(run_cfg.trainer.seed, workers=True, verbose=False)

    rank_zero = is_global_rank_zero()
    try:
        parts, module, datamodule = build_run(run_cfg, layout, plan, run_dir, facts)
        manifest = {
            "status": "running",
            # Credentials from the environment or in credential-named keys never reach a file (redaction.py).
            "command": redact(command_line()),
            "config": redact(OmegaConf.to_container(cfg, resolve=True)),
            "hw": run_cfg.hw,
            "world": layout,
            "batch": plan,
            "num_parameters": facts.num_parameters,
            "flops_per_token": facts.flops_per_token,
            "versions": versions(),
            "git": git_commit(),
            "resumed_from": str(checkpoint) if checkpoint else None,
            "restart_attempt": restart_attempt(),
            "strategy_resolved": run_cfg.strategy,
        }
        if rank_zero:
            (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(manifest["config"])))
            redact_yaml_files([run_dir / ".hydra" / name for name in ("config.yaml", "overrides.yaml", "hydra.yaml")])
            write_json_atomic(run_dir / "run.json", manifest)
        # weights_only: a checkpoint is data, never code (rng.py keeps the RNG states loadable this way).
        ckpt_path = str(checkpoint) if checkpoint else None
        parts.trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        if ranks is not None:
            # Past the last collective a rank ending (even non-zero: a non-finite stop) cannot hang the others.
            ranks.stop_watching()
    except BaseException as err:
        crashed = isinstance(err, Exception) and not isinstance(err, ConfigError | RunStopped)
        if crashed:
            record_crash(run_dir, err, parts)
        if crashed and is_child_process():
            # The launcher prints the error of the rank that caused the failure, once: this one's goes to its log.
            log_to_own_file(run_dir, "".join(traceback.format_exception(err)))
            raise RunStopped(FAILED) from None
        if crashed and reports_failures:
            reporting.acquire()  # if the rank watcher holds it, it is ending this process
            raise stop_for_failure(run_dir, manifest, ranks, None, err, report) from None
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

    guard = parts.nonfinite
    stopped = guard is not None and guard.stopped
    failed = ranks.wait() if ranks is not None else []
    if failed and not (stopped and all(code == NONFINITE for _, code in failed)):
        raise RuntimeError(f"local ranks exited with errors: {failed}")
    if not rank_zero:
        if stopped:
            raise RunStopped(NONFINITE)
        return
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
        predicted_memory_bytes=predicted_memory_bytes,
        measured_memory_bytes=measured_peak_memory(),
        memory_kind="peak RSS" if run_cfg.hw.accelerator == "cpu" else "peak allocated",
    )
    manifest.update(status="stopped" if stopped else "completed", wall_time_s=result.wall_time_s, result=result)
    manifest["result_gap_to_floor"] = result.gap_to_floor
    if guard is not None:
        manifest["nonfinite"] = {
            "policy": guard.policy,
            "skipped_steps": guard.skipped_steps,
            "stopped_at_step": guard.stopped_at,
            "stop_reason": guard.stop_reason,
        }
    write_json_atomic(run_dir / "run.json", manifest)
    say(describe_result(result))
    if guard is not None and guard.skipped_steps:
        say(f"  skipped     {len(guard.skipped_steps)} step(s) with non-finite loss/gradients: {guard.skipped_steps}")
    if run_cfg.diagnostics.enabled and run_cfg.diagnostics.report:
        say_report(run_dir, parts.trainer if run_cfg.logger.name == "wandb" else None)
    if stopped:
        last = newest_complete(parts.ckpt_dir)
        kept = f"; last good checkpoint: {last.checkpoint}" if last else "; no checkpoint was saved before it"
        raise RunStopped(NONFINITE, f"disttrain: stopped: {guard.stop_reason}{kept}")


def record_crash(run_dir: Path, error: BaseException, parts: TrainerParts | None) -> None:
    """This rank's crash record (diagnostics/crash.py): its error, and the step and phase it was in as far as known."""
    step = phase = None
    if parts is not None:
        trainer = parts.trainer
        step = trainer.global_step + 1  # the step that did not finish (Lightning has left its training state here)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if hasattr(callback, "crash_site"):  # the diagnostics callback knows the phase
                step, phase = callback.crash_site(trainer)
    with contextlib.suppress(Exception):  # the error itself must still reach the user
        write_crash_record(run_dir, global_rank(), error, step, phase)


def log_to_own_file(run_dir: Path, text: str) -> None:
    """Append ``text`` to this process's log file (Hydra's job log: train.log, train_rank<N>.log), not the console."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    record = logging.LogRecord("disttrain", logging.ERROR, __file__, 0, text.rstrip("\n"), None, None)
    for handler in files:
        handler.handle(record)
    if not files:  # Hydra's logging switched off
        with contextlib.suppress(OSError), (run_dir / f"train_rank{global_rank()}.log").open("a") as log:
            log.write(text)


def stop_for_failure(
    run_dir: Path,
    manifest: dict,
    ranks: LocalRanks | None,
    dead: list[tuple[int, int]] | None,
    own_error: BaseException | None,
    report: bool,
) -> RunStopped:
    """Name the rank whose error stopped the job, from the ranks' crash records; record it in run.json and
    failure.json, write the report, print that rank's traceback once (the others' echoes go to their logs) and
    return the stop whose one-line message ends the console."""
    if ranks is not None:
        if dead is None:
            # A peer's connection closing means it is exiting: wait for it, and for its crash record.
            peer_left = own_error is not None and is_peer_failure(type(own_error).__name__, str(own_error))
            dead = ranks.dead(wait_s=30.0 if peer_left else 3.0)
        ranks.kill()
    cause = primary_crash(read_crash_records(run_dir))
    if cause is not None:
        rank, error, trace = cause["rank"], cause["error"], cause.get("traceback") or ""
        site = describe_site(cause.get("step"), cause.get("phase"))
        failure = f"rank {rank} raised " + (f"{site}: " if site else "") + error
        details = {"exception": cause.get("exception"), "step": cause.get("step"), "phase": cause.get("phase")}
    elif dead:
        rank, code = dead[0]
        error, trace, details = describe_exit(code), "", {}
        failure = f"rank {rank} died ({error})"
    else:
        assert own_error is not None, "a failure without a dead rank is this process's own error"
        rank, error = global_rank(), first_line(own_error)
        trace, details = "".join(traceback.format_exception(own_error)), {"exception": type(own_error).__name__}
        failure = f"rank {rank} raised {error}"
    if own_error is not None and (cause is None or cause["rank"] != global_rank()):
        log_to_own_file(run_dir, "".join(traceback.format_exception(own_error)))  # an echo of the failure
    with contextlib.suppress(Exception):  # the job must end whatever happens here
        write_json_atomic(
            run_dir / "run.json", {**manifest, "status": "failed", "failure": failure, "failed_rank": rank, **details}
        )
        source = f"rank {rank}" + (" (local rank started by rank 0)" if rank else "")
        write_failure(run_dir, {"error": error, "source": source, "rank": rank, "traceback": trace[-TRACEBACK_CHARS:]})
    where = ""
    if report:
        written = say_report(run_dir, quiet=True)
        where = f"; report: {written}" if written else ""
    if trace:
        say(trace.rstrip("\n"), file=sys.stderr)
    return RunStopped(FAILED, f"disttrain: {failure}; stopping the job{where}")


def rank_died(run_dir: Path, manifest: dict, rank: int, code: int) -> str:
    """The one-line report of a dead rank; also marks the run failed in run.json (best effort)."""
    failure = f"rank {rank} died ({describe_exit(code)})"
    if manifest:
        with contextlib.suppress(Exception):  # the job must end whatever happens here
            write_json_atomic(run_dir / "run.json", {**manifest, "status": "failed", "failure": failure})
    return f"disttrain: {failure}; stopping the job"


def measured_peak_memory() -> int:
    """Peak bytes this rank used: GPU allocator peak on CUDA, else the process's peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def say_report(run_dir: Path, wandb_trainer: object | None = None, quiet: bool = False) -> Path | None:
    """The bottleneck report, after every rank has finished writing telemetry, through the function that
    ``python -m diagnose`` uses; prints its summary unless ``quiet``. Never fails the run. Returns report.md."""
    from diagnostics.report import diagnose_run
    from disttrain.build import log_report_to_wandb

    try:
        report = diagnose_run(run_dir)
        if not quiet:
            say(report.text_summary())
        if wandb_trainer is not None and log_report_to_wandb(wandb_trainer, run_dir):  # type: ignore[arg-type]
            say("  the report is attached to the wandb run as an artifact")
        return report.written_to / "report.md" if report.written_to else None
    except Exception as err:  # a broken report must not turn a finished training run into a failure
        say(f"disttrain: could not write the diagnostics report: {type(err).__name__}: {err}", file=sys.stderr)
        return None


__all__ = ["ConfigError", "run_from_hydra"]
