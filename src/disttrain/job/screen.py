"""Pre-screening: a trial's config goes through the job's own checks (``prepare`` and the launch check's memory
prediction) in the sweeper's process, before its batch launches. A trial predicted not to fit (or whose sampled
combination is invalid: a micro-batch that does not divide the global batch) is recorded with the reason and
never launched, instead of being found out by an OOM or a config error after its job was scheduled.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf, open_dict

from disttrain.config.errors import ConfigError


def job_config(sweep_config: DictConfig) -> DictConfig:
    """The job's config without Hydra's node (what ``run_from_hydra`` gets)."""
    cfg = OmegaConf.create(OmegaConf.to_container(sweep_config, resolve=False))
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return cfg


def screen(cfg: DictConfig, overrides: list[str]) -> str | None:
    """Why the job of ``cfg`` would be refused before it trains (the job's one-line error), or None when it would
    launch. Memory only where the hw profile states it (``check_memory=false`` launches anyway, as for a run)."""
    from disttrain.job.prepare import check_launchable, prepare

    try:
        prepared = prepare(cfg, None, overrides)
        check_launchable(prepared, here=False)
    except ConfigError as err:
        return str(err)
    return None
