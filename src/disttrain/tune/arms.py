"""Where a tune's runs go: here (``python -m train`` one after the other), or each as a job of the project's
SLURM launcher (``hydra/launcher=slurm``, with ``hydra.launcher.*`` passed through to it).

A SLURM run is a one-job ``python -m train -m hydra/launcher=slurm`` that waits for its job, so it is measured
exactly like a local one (its telemetry, in the run dir the A/B chose). Hydra puts a multirun job in
``hydra.sweep.dir`` joined with ``hydra.sweep.subdir``; an absolute subdir is the run dir itself, and the sweep's
own files (submitit's logs, the one-job sweep report) go beside it, to ``<run dir>.slurm``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from diagnostics.ab.runner import Arm, Launcher, RunOutcome, launch_train, run_train
from disttrain.config.errors import ConfigError, did_you_mean
from disttrain.tune.levers import key_of

LAUNCHER_GROUP = "hydra/launcher"
LAUNCHER_KEYS = "hydra.launcher."
SWEEP_FILES = ".slurm"  # suffix of the directory beside each run that holds its sweep's own files


@dataclass(frozen=True)
class Placement:
    """Where the runs go: ``launcher`` None runs them here; ``settings`` are its ``hydra.launcher.*`` overrides."""

    launcher: str | None = None
    settings: tuple[str, ...] = ()

    def launch(self) -> Launcher:
        return launch_train if self.launcher is None else self._launch_job

    def argv(self, overrides: Iterable[str], run_dir: Path) -> list[str]:
        """``python -m train``'s arguments for one run of ``overrides`` into ``run_dir`` (preflight checks these)."""
        if self.launcher is None:
            return [*overrides, f"hydra.run.dir={run_dir}"]
        sweep = [f"hydra.sweep.dir={run_dir}{SWEEP_FILES}", f"hydra.sweep.subdir={run_dir.resolve()}"]
        return ["-m", f"{LAUNCHER_GROUP}={self.launcher}", *self.settings, *overrides, *sweep]

    def _launch_job(self, arm: Arm, run_dir: Path) -> RunOutcome:
        return run_train(self.argv(arm.overrides, run_dir), run_dir)

    def describe(self) -> str:
        return "here" if self.launcher is None else f"as {self.launcher} jobs ({LAUNCHER_GROUP}={self.launcher})"


def is_placement(override: str) -> bool:
    key = key_of(override)
    return key == LAUNCHER_GROUP or key.startswith(LAUNCHER_KEYS)


def placement(overrides: Iterable[str], launchers: Iterable[str], has_sbatch: bool | None = None) -> Placement:
    """The placement that ``overrides`` (those ``is_placement`` picks) ask for; ConfigError, before anything is
    launched, for a launcher that ``launchers`` (the options of conf/hydra/launcher) does not have, launcher settings
    without a launcher, or a SLURM launcher where no ``sbatch`` can submit."""
    chosen = [o for o in overrides if key_of(o) == LAUNCHER_GROUP]
    settings = tuple(o for o in overrides if key_of(o).startswith(LAUNCHER_KEYS))
    known = sorted(launchers)
    options = ", ".join(f"{LAUNCHER_GROUP}={name}" for name in known)
    if not chosen:
        if settings:
            raise ConfigError(
                key_of(settings[0]), "sets a launcher, but no launcher is chosen", f"add {options} (or drop it)"
            )
        return Placement()
    name = chosen[-1].split("=", 1)[1] if "=" in chosen[-1] else ""
    if name not in known:
        raise ConfigError(
            LAUNCHER_GROUP,
            f"unknown launcher '{name}'{did_you_mean(name, known)}",
            f"use {options} to run every arm as a job, or leave {LAUNCHER_GROUP} out to run them here",
        )
    if name == "slurm" and not (shutil.which("sbatch") is not None if has_sbatch is None else has_sbatch):
        raise ConfigError(
            LAUNCHER_GROUP,
            "slurm: no sbatch on PATH to submit the arms with",
            f"run python -m tune on a SLURM login node, or leave {LAUNCHER_GROUP} out to run the arms here",
        )
    return Placement(name, settings)
