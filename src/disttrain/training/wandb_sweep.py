"""A sweep's runs as one wandb group, and the sweep report attached to that group as a run of its own.

A Hydra sweep is not a wandb sweep (no wandb controller chooses its points), so the runs are tied together the way
wandb groups related runs: every job of a multirun logs into the group named after its sweep directory, and once
the sweep ends one more run in that group (job type ``sweep-report``) holds the sweep report as an artifact and
its summary lines. Which sweep a run belongs to is read from the job's own ``.hydra/hydra.yaml`` (Hydra writes it
for every job of every sweeper), so the spawned ranks need nothing handed down. Imports neither torch nor
Lightning; wandb only when the sweep logs to it.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf


def sweep_group(sweep_dir: Path) -> str:
    """The wandb group of a sweep: its directory's last two parts (Hydra's default is ``multirun/DATE/TIME``)."""
    return f"{sweep_dir.parent.name}_{sweep_dir.name}" if sweep_dir.parent.name else sweep_dir.name


def run_group(run_dir: Path) -> str | None:
    """The wandb group of the job in ``run_dir``: its sweep's, or None for a single run."""
    hydra_yaml = run_dir / ".hydra" / "hydra.yaml"
    if not hydra_yaml.is_file():
        return None
    hydra = OmegaConf.load(hydra_yaml).get("hydra", {})
    if str(hydra.get("mode")) != "RunMode.MULTIRUN" and str(hydra.get("mode")) != "MULTIRUN":
        return None
    return sweep_group(Path(str(hydra.sweep.dir)))


def sweep_logger(sweep_dir: Path) -> dict | None:
    """The ``logger`` block the sweep's jobs ran with (from the first job's ``.hydra/config.yaml``)."""
    for config in sorted(sweep_dir.glob("*/.hydra/config.yaml")):
        logger = OmegaConf.to_container(OmegaConf.load(config)).get("logger")  # type: ignore[union-attr]
        if isinstance(logger, dict):
            return logger
    return None


def attach_sweep_report(sweep_dir: Path, report_dir: Path, summary: str) -> str | None:
    """Log the sweep report into the sweep's wandb group, where its jobs logged to wandb; returns where it went
    (the offline run's directory or the online run's URL), None where the sweep does not log to wandb."""
    logger = sweep_logger(sweep_dir)
    if not logger or logger.get("name") != "wandb":
        return None
    import wandb

    mode = str(logger.get("mode", "offline"))
    os.environ.setdefault("WANDB_MODE", mode)
    group = sweep_group(sweep_dir)
    run = wandb.init(
        project=logger.get("project"),
        entity=logger.get("entity"),
        group=group,
        job_type="sweep-report",
        name=f"{group}-report",
        dir=str(sweep_dir),
        mode=mode,
        settings=wandb.Settings(silent=True),
    )
    artifact = wandb.Artifact(f"sweep-report-{run.id}", type="sweep-report")
    artifact.add_dir(str(report_dir))
    run.log_artifact(artifact)
    run.summary["sweep_summary"] = summary
    where = run.dir if mode == "offline" else (run.url or run.dir)
    run.finish()
    return str(Path(where).parent) if mode == "offline" else where
