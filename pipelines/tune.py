"""``python -m tune [python -m train overrides] [tune.key=value ...] [hydra/launcher=slurm]``: a run that tunes
itself (docs/tune.md); with a launcher, every run is one of its jobs.

Kept thin: the ``tune.*`` keys compose conf/tune.yaml into typed settings, the rest is a train command checked by
the same preflight as ``python -m train``; both fail with one line and exit code 2 before any run starts.
``disttrain.tune`` does the rest.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf

from disttrain.config.errors import USER_ERROR_EXIT_CODE, ConfigError, did_you_mean
from disttrain.tune.arms import LAUNCHER_GROUP, Placement, is_placement, placement
from disttrain.tune.levers import key_of
from disttrain.tune.loop import BASE_DIR, Tuner, measurement_pins
from disttrain.tune.settings import TuneSettings, parse_tune_settings

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
TUNE_PREFIX = "tune."
# Keys tune sets itself on every run: the user sets them through tune.* instead.
OWNED = {"trainer.max_steps": "tune.steps", "hydra.run.dir": "tune.output_dir"}


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(tune overrides without their ``tune.`` prefix kept, train overrides)."""
    tune = [a for a in argv if key_of(a).startswith(TUNE_PREFIX)]
    return tune, [a for a in argv if a not in tune]


def arms_placement(argv: list[str]) -> tuple[Placement, list[str]]:
    """Where the runs go (``hydra/launcher=...`` and its ``hydra.launcher.*`` settings, checked against the options
    of conf/hydra/launcher) and the train overrides without those."""
    launchers = [p.stem for p in (CONF_DIR / LAUNCHER_GROUP).glob("*.yaml")]
    return placement([a for a in argv if is_placement(a)], launchers), [a for a in argv if not is_placement(a)]


def tune_settings(overrides: list[str]) -> TuneSettings:
    """conf/tune.yaml with ``overrides``; an unknown ``tune.*`` key names the known ones."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        known = list(compose(config_name="tune").tune.keys())
        for override in overrides:
            name = key_of(override)[len(TUNE_PREFIX) :]
            if name not in known:
                raise ConfigError(
                    key_of(override),
                    f"is not a tune setting{did_you_mean(name, known)}",
                    f"use one of {', '.join(TUNE_PREFIX + k for k in known)}",
                )
        try:
            cfg = compose(config_name="tune", overrides=overrides)
        except HydraException as err:
            raise ConfigError("tune", f"cannot read the overrides ({str(err).splitlines()[0]})", "check them") from None
    return parse_tune_settings(OmegaConf.to_container(cfg.tune, resolve=True))  # type: ignore[arg-type]


HELP_FLAGS = ("-h", "--help")


def usage() -> str:
    """``--help``: the command's form and every tune setting with its default and meaning, from conf/tune.yaml."""
    lines = [
        "usage: python -m tune [python -m train overrides] [tune.key=value ...] [hydra/launcher=NAME "
        "hydra.launcher.key=value ...]",
        "Trains the run, diagnoses it, A/B-tests the top finding's lever and keeps it only where the A/B confirms it",
        "(docs/tune.md). The train overrides take python -m train's groups and keys (python -m train --help).",
        "tune settings (conf/tune.yaml):",
    ]
    block = (CONF_DIR / "tune.yaml").read_text().split("\ntune:\n", 1)[1]
    settings: list[tuple[str, str]] = []
    above: list[str] = []  # comment lines over a key explain it (tune.allow's lever classes)
    for line in (text.strip() for text in block.splitlines()):
        if line.startswith("#"):
            above.append(line.lstrip("# "))
        elif ":" in line:
            key, rest = line.split(":", 1)
            value, _, comment = rest.partition("#")
            settings.append((f"{TUNE_PREFIX}{key}={value.strip()}", " ".join([*above, comment.strip()]).strip()))
            above = []
    width = max(len(setting) for setting, _ in settings)
    lines += [f"  {setting:<{width}}  {comment}".rstrip() for setting, comment in settings]
    return "\n".join(lines)


def check_train_overrides(overrides: list[str]) -> None:
    for override in overrides:
        key = key_of(override)
        if override in ("-m", "--multirun"):
            raise ConfigError("-m", "tune runs its own rounds of single runs", "drop -m")
        if override.startswith("-"):
            raise ConfigError(
                override,
                "is not an option of tune",
                "pass python -m train overrides and tune.key=value only (python -m tune --help lists the settings)",
            )
        if key in OWNED or key.startswith("hydra."):
            owner = OWNED.get(key, "tune.output_dir")
            raise ConfigError(key, "is set by tune for every run", f"set {owner} instead")


def tune_dir(settings: TuneSettings) -> Path:
    """``tune.output_dir``, else ``outputs/<date>/<time>`` like a train run (with a suffix if that one exists)."""
    if settings.output_dir is not None:
        if settings.output_dir.exists() and any(settings.output_dir.iterdir()):
            raise ConfigError(
                "tune.output_dir", f"{settings.output_dir} is not empty", "pass a new directory, or leave it unset"
            )
        return settings.output_dir
    stamp = Path("outputs") / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")
    path, n = stamp, 1
    while path.exists():
        path, n = stamp.with_name(f"{stamp.name}-{n}"), n + 1
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in HELP_FLAGS for a in argv):
        print(usage())
        return 0
    try:
        tune_overrides, train_overrides = split_argv(argv)
        settings = tune_settings(tune_overrides)
        arms, train_overrides = arms_placement(train_overrides)
        check_train_overrides(train_overrides)
        directory = tune_dir(settings)
        from disttrain.job.preflight import preflight  # the train command's own checks, before any run starts

        pins = measurement_pins(train_overrides, settings.steps)
        preflight(arms.argv([*train_overrides, *pins], directory / BASE_DIR), CONF_DIR)
    except ConfigError as err:
        print(f"tune: config error: {err}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()} - {"hydra"}
    print(
        f"tune: {directory}: up to {settings.max_rounds} A/B test(s) in {settings.budget_min:g} min, "
        f"{settings.steps} steps per run, run {arms.describe()}"
    )
    summary = Tuner(train_overrides, settings, directory.resolve(), groups, launch=arms.launch()).run()
    return 1 if summary.error else 0


if __name__ == "__main__":
    sys.exit(main())
