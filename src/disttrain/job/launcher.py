"""How this process takes part in launching its job, decided in one place: what kind of launcher it is, which
ranks it starts and when, whom it watches, and whether it trains at all.

Every ``python -m train`` process is one ``LaunchKind`` (``Launcher.kind``), read from its role (launch/env.py:
the variables launchers set) and its job's config:

- ``FORK`` / ``EXEC``: the process the user started (or an attempt the supervisor runs) of a world > 1 on this
  node. It starts local ranks 1..n-1 (launch/local.py) and joins as rank 0. Checked by preflight in this process,
  its ranks start early: forked right after its imports on CPU (``FORK``: none imports torch again,
  launch/fork.py), as new interpreters before them elsewhere (``EXEC``: every rank imports at once; CUDA cannot
  be used in a forked child). A multirun's job and a restart attempt prepare their own config after the imports:
  their ranks start as new interpreters when the job spawns them.
- ``SUPERVISOR``: ``trainer.max_restarts`` on the user's process: it runs the job's attempts, each a process
  tree of its own, and trains nothing (launch/supervise.py).
- ``SPAWNED_RANK``: a local rank: it dies with its launcher and, unsupervised, records that death first
  (job/launcher_death.py); under the supervisor, the supervisor sees it.
- ``CLUSTER_TASK``: a task torchrun or SLURM started: the world exists already; it spawns nothing.
- ``ONE_PROCESS``: a world of one: a torch-free watcher records its death (``watch_this_process``).

Ranks started early that the job never takes (it failed between the start and the spawn) are killed
(``discard``): none outlives its job. The run dir was claimed before any of this, by the user's process
(job/claim.py, from preflight): every other process joins the dir it claimed.
"""

from __future__ import annotations

import enum
import os
import subprocess
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from hydra.core.global_hydra import GlobalHydra

from disttrain.job.launcher_death import report_launcher_death, watch_this_process
from disttrain.job.prepare import Prepared
from disttrain.launch.env import ProcessRole, process_role
from disttrain.launch.fork import pools_untouched
from disttrain.launch.local import LocalRanks, child_command, die_with_parent, spawn_local_ranks, start_local_ranks
from disttrain.launch.supervise import supervise


class LaunchKind(enum.Enum):
    FORK = "local launch, ranks forked after its imports"
    EXEC = "local launch, ranks started as new interpreters"
    SUPERVISOR = "restart supervisor (trainer.max_restarts)"
    SPAWNED_RANK = "local rank spawned by rank 0"
    CLUSTER_TASK = "task of a cluster launcher (torchrun, SLURM)"
    ONE_PROCESS = "one process"


@dataclass
class Launcher:
    """This process's part in its job's launch. ``checked``: what preflight prepared in this process (None: the
    job prepares its own after the imports: a multirun's job, a restart attempt, a rank, a cluster task)."""

    role: ProcessRole
    run_dir: Path
    module_name: str
    task_overrides: list[str]
    checked: Prepared | None = None
    forks: bool = False  # decided before the imports (``start_before_imports``): a pool may exist after them
    _early: LocalRanks | None = field(default=None, repr=False)

    @classmethod
    def of_this_process(
        cls, checked: Prepared | None, run_dir: Path, module_name: str, task_overrides: list[str]
    ) -> Launcher:
        """The role read once, before anything is spawned: spawning sets this process's NODE_RANK (it would then
        look like a cluster task)."""
        return cls(process_role(), run_dir, module_name, list(task_overrides), checked)

    def kind(self, prepared: Prepared | None = None) -> LaunchKind:
        """What this process is for the job ``prepared`` (default: what preflight checked)."""
        prepared = prepared or self.checked
        if self.role.child:
            return LaunchKind.SPAWNED_RANK
        if self.role.cluster:
            return LaunchKind.CLUSTER_TASK
        if prepared is None:
            raise ValueError("the launcher's kind needs the job's config: prepare it first")
        if prepared.run_cfg.trainer.max_restarts and self.role.starts_the_job:
            return LaunchKind.SUPERVISOR
        if prepared.parallel.world_size == 1:
            return LaunchKind.ONE_PROCESS
        return LaunchKind.FORK if self.forks else LaunchKind.EXEC

    def starts_early(self) -> bool:
        """Whether this is a plain local launch checked here, whose ranks start before the job is built."""
        checked = self.checked
        if checked is None or checked.attempt or checked.run_cfg.dry_run:
            return False
        return self.role.starts_the_job and self.kind() in (LaunchKind.FORK, LaunchKind.EXEC)

    def start_before_imports(self) -> None:
        """Asked before this process imports torch: whether its ranks fork later (a CPU job whose process has not
        touched a fork-unsafe pool); else start them now as new interpreters, where they start early."""
        cpu = self.checked is not None and self.checked.run_cfg.hw.accelerator == "cpu"
        self.forks = cpu and pools_untouched() and self.starts_early()
        if self.starts_early() and not self.forks:
            self._start(fork=False)

    def start_after_imports(self) -> None:
        """Fork the ranks now that this process has imported what they run (``FORK`` only)."""
        if self.forks and self._early is None:
            self._start(fork=True)

    def _start(self, fork: bool) -> None:
        assert self.checked is not None  # starts_early refused None
        command = partial(child_command, self.module_name, self.task_overrides, str(self.run_dir))
        reset = _as_new_interpreter if fork else None
        self._early = start_local_ranks(self.checked.parallel.devices_per_node, command, os.getcwd(), reset)

    def discard(self) -> None:
        """Kill ranks started early that the job did not take (it ended before its spawn)."""
        early, self._early = self._early, None
        if early is not None:
            early.kill()

    def watch_own_launcher(self) -> None:
        """A spawned rank or attempt must not outlive the process that started it; an unsupervised rank also
        records its launcher's death (nobody else can); under the supervisor, the supervisor does."""
        if self.role.child and not self.role.supervised:
            die_with_parent(partial(report_launcher_death, self.run_dir))
        else:
            die_with_parent(None)  # a no-op for a process nobody of ours started

    def supervise(self, restarts: int) -> int:
        """Run the job's attempts (``SUPERVISOR``); the final exit code."""
        return supervise(self.module_name, self.task_overrides, self.run_dir, restarts, os.getcwd())

    def join(self, prepared: Prepared) -> LocalRanks | None:
        """Local ranks 1..n-1 of ``prepared``, this process joined as rank 0: those started early, else started
        now (None: this process spawns no ranks)."""
        if self.kind(prepared) not in (LaunchKind.FORK, LaunchKind.EXEC):
            return None
        early, self._early = self._early, None
        if early is None:
            command = partial(child_command, self.module_name, self.task_overrides, str(self.run_dir))
            return spawn_local_ranks(prepared.parallel.devices_per_node, command, cwd=os.getcwd())
        early.become_rank_zero()
        return early

    def took_early_ranks(self) -> bool:
        """Whether ranks were started before the job was built (they may be writing into the run dir already)."""
        return self._early is not None

    def watch_alone(self, prepared: Prepared) -> subprocess.Popen | None:
        """``ONE_PROCESS`` of the user's own launch: the torch-free watcher of this process (None otherwise)."""
        if self.kind(prepared) is not LaunchKind.ONE_PROCESS or self.role.supervised:
            return None
        return watch_this_process(self.run_dir)


def _as_new_interpreter() -> None:
    """In a forked rank: drop what this process's own job left in module state (Hydra's global config), which a
    new interpreter would not have."""
    GlobalHydra.instance().clear()
