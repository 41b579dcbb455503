"""Which process this is: its rank, its world, and who started it (read from the environment, nothing else).

A ``python -m train`` process is one of: the process the user started (which becomes local rank 0, or the
restart supervisor), a local rank that process spawned (``launch/local.py``), an attempt the supervisor runs
(``launch/supervise.py``), or a task a cluster launcher started (SLURM, torchrun). Every question about that
is answered here, from the variables those launchers set. Imports nothing beyond the standard library.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

CHILD_ENV_FLAG = "DISTTRAIN_CHILD_RANK"  # set in the local ranks launch/local.py spawns
PARENT_PID_ENV = "DISTTRAIN_PARENT_PID"  # the process that spawned this one (it dies with it)
ATTEMPT_ENV = "DISTTRAIN_RESTART_ATTEMPT"  # set in every attempt the restart supervisor runs
CLUSTER_ENV = ("SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "NODE_RANK", "GROUP_RANK")

say = partial(print, flush=True)  # a console line now, not when the buffer fills (ranks interleave)


@dataclass(frozen=True)
class ProcessRole:
    global_rank: int
    local_rank: int
    launched_world_size: int | None  # what a launcher set (WORLD_SIZE, SLURM_NTASKS); None when nothing did
    child: bool  # a local rank spawned by launch/local.py
    supervised: bool  # an attempt run by the restart supervisor
    cluster: bool  # started by a launcher that set up the world itself (SLURM, torchrun, Lightning's children)
    attempt: int  # 0 for a first launch, k for the k-th restart (ours, torchrun's, or a requeued SLURM job's)

    @property
    def is_global_zero(self) -> bool:
        return not self.child and self.global_rank == 0

    @property
    def starts_the_job(self) -> bool:
        """The process the user started: it checks the command, spawns local ranks or supervises restarts."""
        return not self.child and not self.supervised and not self.cluster


def process_role(env: Mapping[str, str] | None = None) -> ProcessRole:
    env = os.environ if env is None else env
    restarts = env.get("TORCHELASTIC_RESTART_COUNT") or env.get("SLURM_RESTART_COUNT")
    world = env.get("WORLD_SIZE") or env.get("SLURM_NTASKS") or ""
    return ProcessRole(
        # A local rank spawned by rank 0 (single node) carries its rank only in CHILD_ENV_FLAG.
        global_rank=int(env.get("RANK") or env.get("SLURM_PROCID") or env.get(CHILD_ENV_FLAG) or 0),
        local_rank=int(env.get("LOCAL_RANK") or env.get("SLURM_LOCALID") or 0),
        launched_world_size=int(world) if world.isdigit() else None,
        child=CHILD_ENV_FLAG in env,
        supervised=ATTEMPT_ENV in env,
        cluster=any(k in env for k in CLUSTER_ENV),
        attempt=int(env.get(ATTEMPT_ENV) or restarts or 0),
    )


def say_once(*args: object, **kwargs: object) -> None:
    """``say`` on global rank 0 only: a line about the whole job, printed once however many ranks run it."""
    if process_role().is_global_zero:
        say(*args, **kwargs)  # type: ignore[arg-type]


def cpu_threads(configured: int | None, local_processes: int, environ: Mapping[str, str] | None = None) -> int:
    """Intra-op threads for a CPU rank: ``trainer.num_threads`` when set, else ``OMP_NUM_THREADS`` (torch and every
    OpenMP program honour it; torchrun sets it to 1 for several processes per node), else the cores shared by the
    local ranks.

    A process that takes every core while another job shares them loses more than its share: its threads wait at
    each op's barrier for a sibling the scheduler parked (one rank beside a 2-rank run on 2 cores: 690-800 ms a step
    with 2 threads, 552-653 ms with 1)."""
    if configured:
        return configured
    omp = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    return max(1, (os.cpu_count() or 1) // max(1, local_processes))
