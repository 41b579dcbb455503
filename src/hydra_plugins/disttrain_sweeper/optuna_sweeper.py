"""The Optuna sweeper (``hydra/sweeper=optuna``) on Optuna's ask/tell API; the logic lives in ``disttrain.sweep``.

A batch: ask up to ``n_jobs`` trials, screen each one's config (``disttrain.job.screen``: a trial predicted
not to fit is recorded and not launched, and another is asked in its place), launch the rest through whatever
launcher is configured (local, ``hydra/launcher=slurm``), each job told its trial (``trial.*``) so it can report
its validation losses for pruning, then tell the study each job's outcome from its run dir. Repeats until the
study holds ``n_trials`` finished trials (a grid: at most the grid), so a rerun continues where a dead sweep
stopped. Hydra only instantiates sweepers from the ``hydra_plugins`` package, hence this module's home.
"""

import logging
from pathlib import Path
from typing import Any, List, Optional  # noqa: UP035

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from disttrain.job.screen import job_config, screen
from disttrain.sweep.space import build_search_space
from disttrain.sweep.study import JOB_ATTR, SWEEP_DIR_ATTR, link_overrides, open_study, storage_url, sweep_settings
from disttrain.sweep.trials import (
    best_summary,
    counted,
    next_job_number,
    outcome,
    record_study,
    recover_interrupted,
    screen_out,
    tell_outcome,
)

log = logging.getLogger(__name__)


class OptunaSweeper(Sweeper):
    def __init__(self, **node: Any) -> None:
        self.node = {
            k: OmegaConf.to_container(v, resolve=True) if isinstance(v, DictConfig) else v for k, v in node.items()
        }
        self.config: Optional[DictConfig] = None  # noqa: UP045
        self.hydra_context: Optional[HydraContext] = None  # noqa: UP045
        self.launcher: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def job_dir(self, ret: JobReturn, num: int, sweep_dir: Path) -> Path:
        if ret.hydra_cfg is not None:
            return Path(str(ret.hydra_cfg.hydra.runtime.output_dir))
        return sweep_dir / str(num)

    def screen(self, overrides: List[str]) -> Optional[str]:  # noqa: UP006, UP045
        assert self.hydra_context is not None and self.config is not None
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        return screen(job_config(sweep_config), overrides)

    def sweep(self, arguments: List[str]) -> Any:  # noqa: UP006
        assert self.config is not None
        objective = str(self.config.objective)
        settings = sweep_settings(self.node, objective)
        space = build_search_space(OverridesParser.create().parse_overrides(arguments), self.node.get("params"))
        grid = space.grid() if settings.sampler["name"] == "grid" else None
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).absolute()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        url = storage_url(settings, sweep_dir)
        study = open_study(settings, url, grid)
        record_study(sweep_dir, url, study, objective)
        for line in recover_interrupted(study, sweep_dir, objective):
            log.info(line)
        target = settings.n_trials if grid is None else min(settings.n_trials, space.grid_size())
        if counted(study):
            log.info(f"continuing study '{study.study_name}': {counted(study)} of {target} trials done")
        failed: list[JobReturn] = []
        returns: list[JobReturn] = []
        while (remaining := target - counted(study)) > 0:
            batch: list[tuple[int, list[str]]] = []
            asked = 0
            while asked < min(settings.n_jobs, remaining):
                asked += 1
                trial = study.ask(space.distributions)
                overrides = space.job_overrides(trial.params)
                reason = self.screen(overrides)
                if reason is not None:
                    screen_out(study, trial, reason)
                    log.info(f"trial {trial.number} screened out, not launched: {' '.join(overrides)}: {reason}")
                    continue
                trial.set_user_attr(SWEEP_DIR_ATTR, str(sweep_dir))
                batch.append((trial.number, [*overrides, *link_overrides(url, study.study_name, trial.number)]))
            if not batch:
                continue
            first = next_job_number(sweep_dir)
            for offset, (number, _) in enumerate(batch):
                study._storage.set_trial_user_attr(
                    study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number),
                    JOB_ATTR,
                    str(first + offset),
                )
            batch_returns = self.launcher.launch([overrides for _, overrides in batch], initial_job_idx=first)
            for offset, ((number, _), ret) in enumerate(zip(batch, batch_returns, strict=True)):
                returns.append(ret)
                if ret.status == JobStatus.FAILED:
                    failed.append(ret)
                    tell_outcome(
                        study, number, "fail", None, f"{type(ret._return_value).__name__}: {ret._return_value}"
                    )
                    continue
                state, value = outcome(self.job_dir(ret, first + offset, sweep_dir), objective)
                tell_outcome(study, number, "fail" if state == "unfinished" else state, value)
        self.finish(study, sweep_dir)
        if failed:
            return failed[0].return_value  # raises the first failure: the multirun ends non-zero, naming it
        return [returns]

    def finish(self, study: Any, sweep_dir: Path) -> None:
        from disttrain.job.sweeps import write_report_quietly

        best = best_summary(study)
        if best is not None:
            (sweep_dir / "optimization_results.yaml").write_text(yaml.safe_dump(best, sort_keys=False))
            log.info(
                f"best trial {best['best_trial']} (job {best['best_job']}): {best['best_value']} {best['best_params']}"
            )
        write_report_quietly(sweep_dir)  # with the study's last word (pruned, screened) on every trial
