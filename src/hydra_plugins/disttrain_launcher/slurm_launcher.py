"""``hydra/launcher=slurm``: every job of a sweep is a SLURM job with one task per device.

Built on hydra-submitit-launcher, which submits the jobs as a SLURM array and runs the Hydra job in each task.
Three things differ, because a sweep of distributed runs must survive its failures:

- ``launch`` waits for every job and turns a job that died (a crashed rank, a node failure, a job killed at its
  time limit) into a failed ``JobReturn`` instead of raising at the first one, so the other jobs are still
  collected; the failure is written to that job's run dir (``failure.json``), and the sweep report
  (``diagnostics.report.sweep``) is written into the sweep dir before Hydra reports the failures.
- In a job, a task whose Hydra job failed exits non-zero: with ``srun --kill-on-bad-exit`` SLURM then stops the
  job's other tasks, which would otherwise wait for the dead rank in their next collective.
- ``max_num_timeout`` is how often a job may requeue itself after its checkpoint on the warning signal
  (``disttrain.reliability.preemption``), handed to the job through the environment.

Hydra only instantiates launchers from the ``hydra_plugins`` package, hence this module's home.
"""

# No `from __future__ import annotations`: Hydra executes plugin modules outside sys.modules, where dataclasses
# cannot resolve string annotations.
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as SubmititSlurmLauncher
from omegaconf import OmegaConf, open_dict

from disttrain.job.sweeps import record_failure, write_report_quietly

log = logging.getLogger(__name__)

# Keys submitit takes without the "slurm_" prefix; every other launcher key is a SLURM-specific parameter.
GENERIC_KEYS = frozenset(OmegaConf.structured(BaseQueueConf).keys())
EXECUTOR_INIT_KEYS = frozenset({"submitit_folder", "max_num_timeout"})


def gpus_per_node(accelerator: str, devices_per_node: int) -> int | None:
    """``--gpus-per-node`` of a hw profile: its devices on GPU profiles, none on CPU ones."""
    return int(devices_per_node) if accelerator == "gpu" else None


# Registered on import: Hydra imports every hydra_plugins module before it composes a config.
OmegaConf.register_new_resolver("disttrain.gpus_per_node", gpus_per_node, replace=True)


@dataclass
class DisttrainSlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.disttrain_launcher.slurm_launcher.SlurmLauncher"
    # Extra srun arguments of each job's step (submitit supports them; the stock launcher config does not).
    srun_args: list[str] = field(default_factory=list)


ConfigStore.instance().store(
    group="hydra/launcher", name="disttrain_slurm", node=DisttrainSlurmConf, provider="disttrain"
)


class SlurmLauncher(SubmititSlurmLauncher):
    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        """In the job: run the Hydra job; a failed one ends this task with exit code 1 (see module doc)."""
        from disttrain.launch.local import secondary_job
        from disttrain.launch.slurm import MAX_REQUEUES_ENV

        os.environ[MAX_REQUEUES_ENV] = str(self.params.get("max_num_timeout") or 0)
        rank = int(os.environ.get("SLURM_PROCID") or 0)
        if rank > 0 and args:  # as local ranks do: its own train_rank<N>.log, rank 0's .hydra/ record
            args = ([*args[0], *secondary_job(f"train_rank{rank}")], *args[1:])
        result = super().__call__(*args, **kwargs)
        if result.status == JobStatus.FAILED:
            err = result._return_value
            print(f"disttrain: job failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            logging.shutdown()
            os._exit(1)
        return result

    def _executor(self) -> Any:
        import submitit

        params = dict(self.params)
        executor = submitit.AutoExecutor(
            folder=params["submitit_folder"], cluster="slurm", slurm_max_num_timeout=params.get("max_num_timeout", 0)
        )
        settings = {
            k if k in GENERIC_KEYS else f"slurm_{k}": v for k, v in params.items() if k not in EXECUTOR_INIT_KEYS
        }
        executor.update_parameters(**settings)
        return executor

    def job_dir(self, overrides: list[str], job_num: int) -> Path:
        """The run dir Hydra gives job ``job_num`` (the sweep dir's timestamp is the sweep's: the cache is copied)."""
        assert self.hydra_context is not None and self.config is not None
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(sweep_config.hydra.job):
            sweep_config.hydra.job.num = job_num
        return Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)

    def launch(self, job_overrides: Any, initial_job_idx: int) -> list[JobReturn]:
        from hydra.core.singleton import Singleton

        assert self.config is not None
        executor = self._executor()
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"SLURM sweep of {len(job_overrides)} job(s) into {sweep_dir}")
        calls = []
        for num, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{num} : {' '.join(overrides)}")
            calls.append((list(overrides), "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state()))
        jobs = executor.map_array(self, *zip(*calls, strict=True))
        for num, job in enumerate(jobs, start=initial_job_idx):
            log.info(f"\t#{num} : SLURM job {job.job_id}")
        returns = [
            self.collect(job, overrides, num)
            for num, (job, overrides) in enumerate(zip(jobs, job_overrides, strict=True), start=initial_job_idx)
        ]
        write_report_quietly(sweep_dir, say=True)
        return returns

    def collect(self, job: Any, overrides: list[str], job_num: int) -> JobReturn:
        """The job's JobReturn; a job that died without one becomes a failed JobReturn with SLURM's error."""
        from submitit.core.utils import FailedJobError, UncompletedJobError

        try:
            return job.results()[0]
        except (FailedJobError, UncompletedJobError) as err:
            run_dir = self.job_dir(list(overrides), job_num)
            state = job.state
            record_failure(
                run_dir,
                err,
                source=f"SLURM job {job.job_id} ended {state}",
                overrides=list(overrides),
                log=str(job.paths.stderr),
            )
            log.error(f"#{job_num} (SLURM job {job.job_id}) failed: {state}; see {run_dir}/failure.json")
            return JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=err)
