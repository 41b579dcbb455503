"""Everything that can be wrong with a ``python -m train`` command, checked before Hydra starts the job.

Hydra itself refuses an unknown group option or key with its own multi-line message and exit code 1, and only
after creating the run dir; ``run_from_hydra`` checks the rest after Hydra has written ``.hydra/`` into it.
``preflight`` runs first, from ``pipelines/train.py``: it reads the overrides with Hydra's own parser, names a
wrong key or option (with a did-you-mean), composes the config exactly as the job will, and runs the same
``prepare`` as the job (resume, typed config, cross-field checks, the run-dir guard). A mistake therefore
exits with code 2 and one line, before any directory is created or any existing run dir is touched.
"""

from __future__ import annotations

import difflib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType, ValueType
from hydra.errors import HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf

from disttrain.checkpoint.resume import original_overrides
from disttrain.config.errors import ConfigError, did_you_mean
from disttrain.job.claim import LaunchDir
from disttrain.job.prepare import Prepared, check_launchable, existing_run, prepare, refuse_existing_run
from disttrain.launch.env import process_role
from disttrain.launch.local import secondary_job
from disttrain.sweep.checks import check_optuna_sweep, is_optuna_sweep

MULTIRUN_FLAGS = ("-m", "--multirun")

# Config values that become names of files or dirs inside the run dir (Hydra's log file, its record dir).
PATH_NAME_KEYS = ("hydra.job.name", "hydra.output_subdir")


def cluster_rank_job(argv: list[str]) -> list[str]:
    """What a non-zero rank that a cluster launcher started with the user's own command (``torchrun -m train``,
    ``srun python -m train``) adds to it: the overrides our local ranks get (its own ``train_rank<N>.log``, rank
    0's ``.hydra/`` record). Without them every rank writes ``.hydra/`` into the shared run dir, and rank 0, which
    checks that the dir holds no earlier run, can find a sibling's record there and refuse the launch."""
    role = process_role()
    if role.child or not role.cluster or role.global_rank == 0 or any(a in MULTIRUN_FLAGS for a in argv):
        return []
    given = {a.lstrip("+~").split("=", 1)[0] for a in argv}
    return [o for o in secondary_job(f"train_rank{role.global_rank}") if o.split("=", 1)[0] not in given]


@dataclass(frozen=True)
class Preflighted:
    """A checked command: the job it prepared (None: a multirun's jobs and restarts prepare their own) and the dir
    this launch must claim before Hydra writes into it (None: this process joins a dir another one claimed)."""

    prepared: Prepared | None
    launch_dir: LaunchDir | None


def dir_to_claim(cfg: DictConfig, multirun: bool, continues_study: bool = False) -> LaunchDir | None:
    """The run (or sweep) dir a first launch's rank 0 claims; the other ranks and restart attempts join it.
    ``continues_study``: an Optuna sweep, whose dir holding its study is continued rather than refused."""
    role = process_role()
    if role.attempt or not role.is_global_zero or role.supervised:
        return None
    key = "sweep" if multirun else "run"
    pattern = OmegaConf.to_container(cfg.hydra[key], resolve=False)["dir"]  # type: ignore[index]
    return LaunchDir(f"hydra.{key}.dir", Path(str(cfg.hydra[key].dir)), "${now:" in str(pattern), continues_study)


# -- the command line, before Hydra ---------------------------------------------------------------------------
def parse_overrides(overrides: list[str]) -> list[Override]:
    parsed = []
    for text in overrides:
        try:
            parsed.extend(OverridesParser.create().parse_overrides([text]))
        except OverrideParseException as err:
            key = text.split("=", 1)[0].lstrip("+~")
            problem = f"cannot read the override '{text}' ({str(err).splitlines()[0]})"
            raise ConfigError(key, problem, "write key=value or group=option; quote values with spaces") from None
    return parsed


def values_of(override: Override) -> list[str]:
    """The values a sweep override lists; for an interval (a sweeper such as Optuna samples it) only its start,
    which stands for the values the jobs will get when the command is checked (of the same type: Optuna samples
    integers only from int(interval(1, 8)), whose bounds are then ints)."""
    if override.value_type == ValueType.INTERVAL_SWEEP:
        return [str(override.value().start)]
    if override.is_sweep_override():
        return [str(v) for v in override.sweep_string_iterator()]
    value = override.value()
    return [] if value is None else [str(value)]


def first_job(override: Override) -> str:
    """The override as the first job of a sweep sees it (compose() takes no sweeps)."""
    if not override.is_sweep_override():
        return override.input_line
    return f"{override.get_key_element()}={values_of(override)[0]}"


def sweep_jobs(overrides: list[Override]) -> list[list[str]]:
    """Every job of a sweep Hydra's basic sweeper runs, as its overrides: the product of the listed values, in the
    order Hydra launches them."""
    options = [
        [f"{o.get_key_element()}={v}" for v in values_of(o)] if o.is_sweep_override() else [o.input_line]
        for o in overrides
    ]
    return [list(job) for job in itertools.product(*options)]


def check_sweep_job(number: int, job: list[str], overrides: list[Override], here: bool) -> None:
    """What the job's own start-up would refuse, refused now: a later job's bad value otherwise fails only after
    the jobs before it have trained. The error names the job by its swept values."""
    try:
        try:
            cfg = compose(config_name="train", overrides=job, return_hydra_config=True)
        except HydraException as err:
            message = str(err).splitlines()[0]
            raise ConfigError("overrides", f"cannot compose the config ({message})", "check the overrides") from None
        check_launchable(prepare(cfg, None, [o for o in job if not o.lstrip("+~").startswith("hydra")]), here)
    except ConfigError as err:
        swept = " ".join(value for value, o in zip(job, overrides, strict=True) if o.is_sweep_override())
        raise ConfigError(err.key, f"{err.problem} (in sweep job #{number}: {swept})", err.fix) from None


def check_plain_name(key: str, value: str) -> None:
    """A value used as a file or dir name inside the run dir must not lead out of it."""
    if value != "null" and ("/" in value or "\\" in value or value in (".", "..")):
        raise ConfigError(
            key,
            f"'{value}' is used as a name inside the run dir but contains a path",
            f"use a plain name (e.g. {key}=train) and choose the directory with hydra.run.dir",
        )


def config_groups(conf_dir: Path) -> set[str]:
    """The config groups a command may choose options of (``model``, ``hw``, ...); Hydra's own are not ours."""
    return {p.name for p in conf_dir.iterdir() if p.is_dir()} - {"hydra"}


SEARCHPATH = "hydra.searchpath"


def searchpath_dirs(overrides: list[Override]) -> list[Path] | None:
    """The config dirs ``hydra.searchpath=[file:///my/conf]`` adds (a lightning-hydra-template user's own
    ``configs/``, where their ``model/<name>.yaml`` lives); None where an entry is a package (``pkg://``), whose
    options only Hydra can list."""
    dirs: list[Path] = []
    for o in overrides:
        if o.key_or_group != SEARCHPATH:
            continue
        value = o.value()
        for entry in value if isinstance(value, list) else [value]:
            entry = str(entry)
            if entry.startswith("pkg://"):
                return None
            dirs.append(Path(entry.removeprefix("file://")).expanduser())
    return dirs


def check_group_option(conf_dir: Path, override: Override, extra_dirs: list[Path] | None) -> None:
    """An option of a group: a yaml of conf/<group>/ or of a searchpath dir's <group>/ (None: not checkable)."""
    if extra_dirs is None:
        return
    group = override.key_or_group
    options = sorted({p.stem for d in (conf_dir, *extra_dirs) for p in (d / group).glob("*.yaml")})
    for value in values_of(override):
        if value != "null" and value not in options:
            close = difflib.get_close_matches(value, options, n=1, cutoff=0.6)
            raise ConfigError(
                group,
                f"unknown option '{value}'{did_you_mean(value, options)}",
                f"choose one of {options} (conf/{group}/), e.g. {group}={(close or options)[0]}",
            )


def has_key(cfg: DictConfig, key: str) -> bool:
    """Whether ``key`` (dotted) exists, including keys whose value is the required-but-unset ``???``."""
    node: Any = cfg
    for part in key.split("."):
        # keys() lists ``???`` entries too, which ``in`` and OmegaConf.select treat as absent.
        if not isinstance(node, DictConfig) or part not in node.keys():  # noqa: SIM118 (see above)
            return False
        node = node._get_node(part)
    return True


def resumed_group_choices(overrides: list[Override], groups: set[str]) -> list[Override]:
    """The group options (``strategy=megatron``) the run named by ``resume=`` was started with, if any."""
    resume = next((values_of(o)[0] for o in overrides if o.key_or_group == "resume" and values_of(o)), None)
    if resume is None or not Path(resume).expanduser().exists():
        return []  # the resume checks in prepare() name a wrong path
    return [o for o in parse_overrides(original_overrides(resume)) if o.key_or_group in groups]


def check_resumed_group_repeated(choices: list[str], resumed: list[Override], override: Override) -> DictConfig:
    """Hydra composes this command before the resumed run's config is merged in, so a setting of the resumed run's
    group option (``strategy.tp`` of ``strategy=megatron``) only exists if the command names that option too.
    Returns the config with the resumed run's group options, for reporting a key that exists in neither."""
    with_resumed = compose(config_name="train", overrides=[*(o.input_line for o in resumed), *choices])
    group = override.key_or_group.split(".")[0]
    option = next((o.input_line for o in reversed(resumed) if o.key_or_group == group), None)
    if option is None or not has_key(with_resumed, override.key_or_group):
        return with_resumed
    raise ConfigError(
        override.key_or_group,
        f"is a setting of {option}, the option the resumed run was started with, but this command composes "
        f"the default {group} before the resumed run's config is merged in",
        f"repeat the option on this command: python -m train resume=... {option} {override.input_line}",
    )


def check_key_exists(cfg: DictConfig, key: str) -> None:
    parts = key.split(".")
    for depth in range(1, len(parts) + 1):  # report the first level that does not exist
        if not has_key(cfg, ".".join(parts[:depth])):
            break
    else:
        return
    parent_path, name = ".".join(parts[: depth - 1]), parts[depth - 1]
    parent: Any = OmegaConf.select(cfg, parent_path) if parent_path else cfg
    choices = sorted(str(k) for k in parent.keys()) if isinstance(parent, DictConfig) else []  # noqa: SIM118
    where = parent_path or "the run config"
    custom = " (extra arguments of a custom model/data module are added with +, e.g. +model.width=64)"
    raise ConfigError(
        ".".join(parts[:depth]),
        f"is not a setting of {where}{did_you_mean(name, choices)}",
        f"use one of {choices}{custom if parent_path in ('model', 'data') else ''}",
    )


def check_overrides(argv: list[str], conf_dir: Path, config_name: str) -> None:
    """The one-line errors of ``python -m train`` for another entry point's command (``python -m plan``): an
    unreadable override, an unknown group option or key, anything else Hydra cannot compose. Commands with Hydra's
    own flags are left to Hydra."""
    if any(a.startswith("-") for a in argv):
        return
    overrides = parse_overrides(argv)
    groups = config_groups(conf_dir)
    for o in overrides:
        if o.key_or_group in groups and o.package is None and not o.is_delete():
            check_group_option(conf_dir, o, searchpath_dirs(overrides))
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        try:
            composed = compose(
                config_name=config_name,
                overrides=[o.input_line for o in overrides if o.key_or_group in groups or o.key_or_group == SEARCHPATH],
            )
            for o in overrides:
                if (
                    o.type == OverrideType.CHANGE
                    and o.key_or_group not in groups
                    and not o.key_or_group.startswith("hydra")
                ):
                    check_key_exists(composed, o.key_or_group)
            compose(config_name=config_name, overrides=argv)
        except HydraException as err:
            message = str(err).splitlines()[0]
            raise ConfigError("overrides", f"cannot compose the config ({message})", "check the overrides") from None


def preflight(argv: list[str], conf_dir: Path) -> Preflighted:
    """Raise ConfigError for anything wrong with ``python -m train ARGV``; when it is fine, the prepared job for
    ``run_from_hydra`` to go on with (None for a multirun, whose jobs each prepare their own) and the dir to claim.

    Commands with other Hydra flags (--help, --cfg, -cn, ...) are left to Hydra. Children and restarted
    attempts re-run a command that already passed.
    """
    if process_role().child or process_role().supervised:
        return Preflighted(None, None)
    multirun = any(a in MULTIRUN_FLAGS for a in argv)
    args = [a for a in argv if a not in MULTIRUN_FLAGS]
    if any(a.startswith("-") for a in args):
        return Preflighted(None, None)
    overrides = parse_overrides(args)
    groups = config_groups(conf_dir)
    for o in overrides:
        if o.key_or_group == "hydra/launcher" and not multirun:
            raise ConfigError(
                "hydra/launcher",
                f"{o.input_line} only takes effect in a multirun: without -m this command would train here",
                f"add -m (python -m train -m {o.input_line} ...); one value per key submits a single job",
            )
        if o.is_sweep_override() and not multirun:
            raise ConfigError(
                o.key_or_group,
                f"lists several values ({', '.join(values_of(o))}): that is a sweep",
                "add -m to run one job per value, or give a single value",
            )
        if o.key_or_group in groups and o.package is None and not o.is_delete():
            check_group_option(conf_dir, o, searchpath_dirs(overrides))
        if o.key_or_group in PATH_NAME_KEYS:
            for value in values_of(o):
                check_plain_name(o.key_or_group, value)
    job = [first_job(o) for o in overrides]
    choices = [first_job(o) for o in overrides if o.key_or_group in groups or o.key_or_group == SEARCHPATH]
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        try:
            with_groups = compose(config_name="train", overrides=choices)
        except HydraException as err:
            raise ConfigError("overrides", f"cannot compose the config ({err})", "check the group options") from None
        resumed = resumed_group_choices(overrides, groups)
        for o in overrides:
            plain = o.type == OverrideType.CHANGE and not o.key_or_group.startswith("hydra")
            if plain and o.key_or_group not in groups:
                if resumed and not has_key(with_groups, o.key_or_group):
                    # A typo is then reported against the settings of the run being resumed.
                    check_key_exists(check_resumed_group_repeated(choices, resumed, o), o.key_or_group)
                check_key_exists(with_groups, o.key_or_group)
        try:
            cfg = compose(config_name="train", overrides=job, return_hydra_config=True)
        except HydraException as err:
            message = str(err).splitlines()[0]
            raise ConfigError("overrides", f"cannot compose the config ({message})", "check the overrides") from None
        # Only a first launch's rank 0 claims (as guard_new_run_dir guards): a torchrun/SLURM restart continues in
        # its own run dir, and a cluster's other ranks may start after rank 0 wrote run.json.
        study_sweep = multirun and is_optuna_sweep(cfg)
        claim = dir_to_claim(cfg, multirun, continues_study=study_sweep)
        run_dir = None if multirun else Path(str(cfg.hydra.run.dir))
        if claim is not None and claim.timestamped:
            run_dir = None  # taken, a timestamped dir gets a suffix when claimed: nothing to refuse
        elif run_dir is not None and claim is not None and (marker := existing_run(run_dir)):
            refuse_existing_run(run_dir, marker)  # early, before the slower checks; the claim below decides
        # The run dir too: a restart's checkpoint is its newest one, and on another world size it is what lets the
        # restart train there (fit_elastic_world) instead of being refused for the launcher's rank count.
        prepared = prepare(cfg, run_dir, [first_job(o) for o in overrides if not o.key_or_group.startswith("hydra")])
        if study_sweep:  # after prepare: the sweeper's direction resolves through the objective prepare checked
            check_optuna_sweep(cfg, overrides)
        # A cluster launcher (hydra/launcher=slurm) runs the jobs on other machines: this one need not serve them.
        remote = any(o.key_or_group == "hydra/launcher" and values_of(o) != ["basic"] for o in overrides)
        if multirun and not study_sweep:  # an Optuna study samples its jobs; a basic sweep's are known now
            for number, later in enumerate(sweep_jobs(overrides)[1:], start=1):
                check_sweep_job(number, later, overrides, here=not remote)
    # An Optuna sweep screens every trial's memory itself (a trial that does not fit is recorded, not launched):
    # the first listed value not fitting is no reason to refuse the whole sweep.
    check_launchable(prepared, here=not remote, memory=not study_sweep)
    # A multirun's jobs, and a restart (it resumes from its run dir, unknown here), each prepare their own.
    return Preflighted(None if multirun or prepared.attempt else prepared, claim)
