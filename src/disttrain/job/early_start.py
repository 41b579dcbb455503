"""Start the local ranks of a checked job early: on GPUs before rank 0 imports torch/Lightning, so every rank
imports at once; on CPU forked from rank 0 right after its imports, so none imports again (launch/fork.py).

Importing ``disttrain.job.run`` (torch, Lightning, torchmetrics) takes seconds of CPU per process. Spawned from
``run.train`` (after that import), the ranks paid it one after the other; started here, right after ``preflight``
checked the command and Hydra made the run dir, they import while rank 0 does. Nothing else moves: every check of
the user's input has run before this (``preflight``: prepare, the launch check), and rank 0 still joins the job as
local rank 0 (its environment, the rank watcher) where it always did, in ``run.spawn``, which takes the ranks
started here. A job that ends before that kills them (``discard_unclaimed``), so none outlives it.

A CPU job's ranks are forked instead (``forks_its_ranks``): its ranks share the host's few cores, where each new
interpreter's imports are the largest part of a short run's CPU; CUDA cannot be used in a forked child.

Only the plain local launch starts early: a dry run spawns nothing, ``trainer.max_restarts`` makes this process a
supervisor, a multirun's jobs and restart attempts prepare their own config, and cluster tasks spawn nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from hydra.core.global_hydra import GlobalHydra

from disttrain.job.prepare import Prepared
from disttrain.launch.env import process_role
from disttrain.launch.fork import pools_untouched
from disttrain.launch.local import LocalRanks, child_command, start_local_ranks

_started: list[LocalRanks] = []  # ranks started here that run.spawn has not taken yet (at most one job's)


def should_start_early(prepared: Prepared | None) -> bool:
    """Whether this job is a plain local launch whose ranks this process spawns (what ``run.spawn`` would do)."""
    if prepared is None or prepared.attempt:
        return False
    run_cfg = prepared.run_cfg
    return (
        prepared.parallel.world_size > 1
        and process_role().starts_the_job
        and not run_cfg.dry_run
        and not run_cfg.trainer.max_restarts
    )


def forks_its_ranks(prepared: Prepared | None) -> bool:
    """Whether this job's early ranks are forked from this process after its imports (CPU jobs whose process has
    not touched a fork-unsafe thread pool: launch/fork.py), rather than started as new interpreters before them.
    Asked before those imports."""
    cpu = prepared is not None and prepared.run_cfg.hw.accelerator == "cpu"
    return should_start_early(prepared) and cpu and pools_untouched()


def _as_new_interpreter() -> None:
    """In a forked rank: drop what this process's own job left in module state (Hydra's global config, the ranks
    it started), which a new interpreter would not have."""
    _started.clear()
    GlobalHydra.instance().clear()


def maybe_start_local_ranks(
    prepared: Prepared | None, module_name: str, task_overrides: Sequence[str], run_dir: Path, fork: bool = False
) -> LocalRanks | None:
    """Start local ranks 1..n-1 of this job now, if it is one that spawns them; ``take_started_ranks`` hands them on.
    ``fork``: what ``forks_its_ranks`` said before the caller imported what the ranks run."""
    if not should_start_early(prepared):
        return None
    assert prepared is not None  # for the type checker: should_start_early refused None
    command = partial(child_command, module_name, list(task_overrides), str(run_dir))
    reset = _as_new_interpreter if fork else None
    ranks = start_local_ranks(prepared.parallel.devices_per_node, command, cwd=os.getcwd(), fork_reset=reset)
    _started.append(ranks)
    return ranks


def take_started_ranks() -> LocalRanks | None:
    """The ranks started early for this job, now owned by the caller (None: none were)."""
    return _started.pop() if _started else None


def discard_unclaimed() -> None:
    """Kill ranks started early whose job ended before taking them (a failure between preflight and the spawn)."""
    while _started:
        _started.pop().kill()
