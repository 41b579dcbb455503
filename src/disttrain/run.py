"""One training run, from a composed Hydra config to the summary line.

Order matters: everything that can be wrong with the user's input is checked before a process is spawned
or a file is written; only then are local ranks started, the run recorded, and the Trainer fitted.
"""

from __future__ import annotations

import functools
import os
import resource
import sys
import time
from functools import partial
from pathlib import Path

import torch
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from disttrain.build import ModelFacts, model_facts
from disttrain.config.errors import ConfigError
from disttrain.config.parse import parse_run_config
from disttrain.config.schema import AutoStrategyConfig, RunConfig
from disttrain.config.validate import BatchPlan, WorldLayout, batch_plan, validate_run, world_layout
from disttrain.describe import RunResult, describe_launch, describe_result
from disttrain.hardware import check_machine_can_serve, in_cluster_job
from disttrain.launch import child_command, is_child_process, spawn_local_ranks
from disttrain.manifest import command_line, git_commit, versions, write_json_atomic
from disttrain.planning import check_fits, describe_memory, predict_memory, resolve_auto
from disttrain.resume import find_checkpoint, original_overrides

say = functools.partial(print, flush=True)


def is_global_rank_zero() -> bool:
    if is_child_process():
        return False
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0


def compose_for_resume(resume: str, task_overrides: list[str]) -> DictConfig:
    """The resumed run's config: its original overrides, then this command's (later ones win)."""
    keep = [o for o in original_overrides(resume) + task_overrides if not o.lstrip("+~").startswith("resume=")]
    return compose(config_name="train", overrides=[*keep, f"resume={resume}"])


def run_from_hydra(cfg: DictConfig, module_name: str) -> None:
    started = time.time()
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    task_overrides = list(hydra_cfg.overrides.task)
    if not is_child_process() and (run_dir / "run.json").exists():
        # Two runs started within the same second share Hydra's timestamped dir: never write over the first.
        raise ConfigError(
            "hydra.run.dir",
            f"'{run_dir}' already holds a run (run.json)",
            "start again in a moment or pass hydra.run.dir=<new dir>; to continue that run use resume=<that dir>",
        )
    checkpoint: Path | None = None
    if cfg.get("resume"):
        checkpoint = find_checkpoint(str(cfg.resume))
        cfg = compose_for_resume(str(cfg.resume), task_overrides)
    run_cfg = parse_run_config(cfg)
    layout = world_layout(run_cfg)
    auto_reason = None
    if isinstance(run_cfg.strategy, AutoStrategyConfig):
        run_cfg, auto_reason = resolve_auto(run_cfg, layout, batch_plan(run_cfg))
    plan = validate_run(run_cfg)
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
    if rank_zero and checkpoint is not None:
        say(f"resuming from {checkpoint}")
    command = partial(child_command, module_name, task_overrides, str(run_dir))
    predicted = None if memory is None else memory.total
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
    if layout.world_size > 1 and not is_child_process() and not in_cluster_job():
        ranks = spawn_local_ranks(local_processes, command_for_rank, cwd=os.getcwd())

        def abort(rank: int, code: int) -> None:
            # The survivors would wait forever in their next collective: stop the whole job now.
            say(f"disttrain: local rank {rank} exited with code {code}; stopping the job", file=sys.stderr)
            ranks.kill()
            os._exit(1)

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
            "command": command_line(),
            "config": OmegaConf.to_container(cfg, resolve=True),
            "hw": run_cfg.hw,
            "world": layout,
            "batch": plan,
            "num_parameters": facts.num_parameters,
            "flops_per_token": facts.flops_per_token,
            "versions": versions(),
            "git": git_commit(),
            "resumed_from": str(checkpoint) if checkpoint else None,
            "strategy_resolved": run_cfg.strategy,
        }
        if rank_zero:
            (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
            write_json_atomic(run_dir / "run.json", manifest)
        parts.trainer.fit(module, datamodule=datamodule, ckpt_path=str(checkpoint) if checkpoint else None)
    except BaseException:
        if ranks is not None:
            ranks.kill()
        raise
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Tear the group down explicitly: gloo threads dying at interpreter exit can abort the process.
            torch.distributed.destroy_process_group()

    if ranks is not None and (failed := ranks.wait()):
        raise RuntimeError(f"local ranks exited with errors: {failed}")
    if not rank_zero:
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
    manifest.update(status="completed", wall_time_s=result.wall_time_s, result=result)
    manifest["result_gap_to_floor"] = result.gap_to_floor
    write_json_atomic(run_dir / "run.json", manifest)
    say(describe_result(result))
    if run_cfg.diagnostics.enabled and run_cfg.diagnostics.report:
        say_report(run_dir, parts.trainer if run_cfg.logger.name == "wandb" else None)


def measured_peak_memory() -> int:
    """Peak bytes this rank used: GPU allocator peak on CUDA, else the process's peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def say_report(run_dir: Path, wandb_trainer: object | None = None) -> None:
    """The bottleneck report, after every rank has finished writing telemetry. Never fails the run."""
    from disttrain.build import log_report_to_wandb, write_run_report

    try:
        say(write_run_report(run_dir))
        if wandb_trainer is not None and log_report_to_wandb(wandb_trainer, run_dir):  # type: ignore[arg-type]
            say("  the report is attached to the wandb run as an artifact")
    except Exception as err:  # a broken report must not turn a finished training run into a failure
        say(f"disttrain: could not write the diagnostics report: {type(err).__name__}: {err}", file=sys.stderr)


__all__ = ["ConfigError", "run_from_hydra"]
