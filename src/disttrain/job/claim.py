"""A launch claims its run or sweep dir with an exclusive create before anything is written into it.

Two launches in the same second resolve Hydra's default ``outputs/<date>/<time>`` to the same path, and both
found it empty when the guard was a check followed by a write. Now the process the user started creates
``<dir>/.claim.json`` with ``O_CREAT | O_EXCL``, which exactly one process can do (atomic on local filesystems
and on NFSv3+/Lustre, so also between launches on different nodes of a shared filesystem), and only then hands
the dir to Hydra. A timestamped dir (the default's ``${now:...}``) that another launch holds is taken with a
suffix instead (``07-27-02-1``, ``-2``, ...); a dir the user named is refused with the usual one-line error.

Only a first launch's rank 0 claims (``preflight`` decides): the local ranks, restart attempts and cluster tasks
of the job join the dir it claimed. Imports nothing beyond the standard library and the error type.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from disttrain.config.errors import ConfigError
from disttrain.sweep.study import STUDY_RECORD

CLAIM_FILE = ".claim.json"
# How many suffixed siblings of a timestamped dir are tried: more launches than this within one second of one
# pattern is not a collision but a loop gone wrong.
MAX_SUFFIX = 999
# What an earlier run or sweep left that shows the dir is taken even without a claim (dirs written before claims).
RUN_MARKERS = ("run.json", ".hydra/overrides.yaml")
SWEEP_MARKERS = ("multirun.yaml",)
# An override value Hydra's grammar reads as the plain string it is; anything else is quoted.
PLAIN_VALUE = re.compile(r"[\w./:+@%~-]+")


@dataclass(frozen=True)
class LaunchDir:
    """The dir one launch writes into: a run's (``hydra.run.dir``) or a multirun's (``hydra.sweep.dir``)."""

    key: str  # the config key that names it: the refusal names it, the claimed path is passed back through it
    path: Path  # as composed, its timestamp resolved
    timestamped: bool  # its pattern holds ${now:...}: taken, it gets a suffix instead of a refusal
    continues_study: bool = False  # an Optuna sweep: its dir holding an ended sweep's study is claimed again

    @property
    def sweep(self) -> bool:
        return self.key == "hydra.sweep.dir"

    @property
    def markers(self) -> tuple[str, ...]:
        return SWEEP_MARKERS if self.sweep else RUN_MARKERS


def describe_claim(claim: Path) -> str:
    """Who claimed the dir, from its claim file (written just after the create: it may still be empty)."""
    try:
        owner = json.loads(claim.read_text(encoding="utf-8"))
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(owner["time"])))
        return f"{CLAIM_FILE}: claimed by pid {owner['pid']} on {owner['host']} at {when}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"{CLAIM_FILE}: claimed by another launch"


def holder(path: Path, markers: tuple[str, ...]) -> str | None:
    """What shows that ``path`` is taken (a launch's claim, an earlier run's files), or None while it is free."""
    if (path / CLAIM_FILE).exists():
        return describe_claim(path / CLAIM_FILE)
    return next((marker for marker in markers if (path / marker).exists()), None)


def try_claim(path: Path, markers: tuple[str, ...]) -> str | None:
    """Claim ``path`` for this process: None when it now owns it, else what holds it (it is then left untouched).

    Reading first only names the holder and refuses dirs written before claims existed; the claim itself is the
    exclusive create, so of two launches that both read a free dir exactly one gets it."""
    if (taken := holder(path, markers)) is not None:
        return taken
    path.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path / CLAIM_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return describe_claim(path / CLAIM_FILE)
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(owner, handle)
        handle.write("\n")
    return None


def candidates(launch: LaunchDir) -> list[Path]:
    """The dirs to try, in order: the composed one, then (timestamped only) its suffixed siblings."""
    if not launch.timestamped:
        return [launch.path]
    return [launch.path, *(launch.path.with_name(f"{launch.path.name}-{n}") for n in range(1, MAX_SUFFIX + 1))]


def refuse_taken(key: str, path: Path, marker: str, sweep: bool = False) -> ConfigError:
    """The one-line error for a dir another run or launch holds: it is never shared or written over."""
    what = "a sweep" if sweep else "a run"
    fix = f"pass {key}=<new dir> (or leave it out: the default dir is new for every launch)"
    if not sweep:
        fix += "; to continue that run use resume=<that dir>"
    return ConfigError(key, f"'{path}' already holds {what} ({marker}); it is never written over", fix)


def claim_launch_dir(launch: LaunchDir) -> Path:
    """Claim the launch's dir (a timestamped one: the first free of it and its suffixed siblings); ConfigError
    when it cannot be claimed."""
    taken: str | None = ""
    for path in candidates(launch):
        try:
            if launch.continues_study and (path / STUDY_RECORD).is_file() and not launch.timestamped:
                if (taken := reclaim_ended(path)) is None:
                    return path
                raise refuse_taken(launch.key, path, taken, launch.sweep)
            taken = try_claim(path, launch.markers)
        except OSError as err:  # a path through a file, no permission: the user's choice of dir, not a crash
            raise ConfigError(
                launch.key, f"cannot create '{path}' ({type(err).__name__}: {err.strerror})", "choose a writable dir"
            ) from None
        if taken is None:
            return path
        if not launch.timestamped:
            raise refuse_taken(launch.key, path, taken, launch.sweep)
    raise ConfigError(
        launch.key,
        f"'{launch.path}' and its {MAX_SUFFIX} suffixed siblings are all taken ({taken})",
        f"pass {launch.key}=<new dir>",
    )


def claim_owner(claim: Path) -> dict | None:
    try:
        owner = json.loads(claim.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def reclaim_ended(path: Path) -> str | None:
    """Claim a sweep dir again to continue its study, once the sweep that claimed it has ended: None when this
    process now owns it, else what holds it (a live sweep on this host, or one on another host, which this
    process cannot see: its claim file names it, and removing that file is the user's call)."""
    claim = path / CLAIM_FILE
    owner = claim_owner(claim)
    if owner is not None:
        here = owner.get("host") == socket.gethostname()
        if not here:
            return f"{describe_claim(claim)}; if that sweep has ended, remove {claim} to continue its study"
        if isinstance(owner.get("pid"), int) and process_alive(owner["pid"]):
            return f"{describe_claim(claim)}, which is still running"
        # The ended sweep's claim is kept beside, renamed: the exclusive create below decides between rivals.
        with contextlib.suppress(FileNotFoundError):
            claim.rename(path / f"{CLAIM_FILE}.ended-{owner.get('pid')}-{time.time():.0f}")
    return try_claim(path, ())


def as_override(key: str, path: Path) -> str:
    """``key=path`` as a Hydra override that reads back as exactly ``path`` (quoted where the grammar needs it)."""
    value = str(path)
    if PLAIN_VALUE.fullmatch(value) and not value[0].isdigit():
        return f"{key}={value}"
    # Inside quotes Hydra reads a backslash literally except before a quote or the closing quote: only those runs
    # of backslashes are doubled, and the quote itself escaped.
    escaped = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value)
    return f"{key}='{escaped}'"
