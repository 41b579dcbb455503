"""Running as one task of a SLURM job: who this task is, where rank 0 listens, and how to requeue the job.

Under ``hydra/launcher=slurm`` SLURM starts one task per device (``srun``, tasks per node = devices per node),
so every task already is a rank: disttrain spawns nothing and Lightning's ``SLURMEnvironment`` reads the ranks
from ``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NODEID``. What it cannot know is the address of the first node
when node names are not host names (the fake nodes of ``tests/slurm/local_cluster.sh`` are ``n1``, ``n2`` on
one host at 127.0.0.1): that comes from ``scontrol show node``'s ``NodeAddr``, which is also right on a real
cluster. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

ATTEMPTS_FILE = "attempts.jsonl"
MAX_REQUEUES_ENV = "DISTTRAIN_SLURM_MAX_REQUEUES"
PORT_BASE, PORT_SPAN = 20000, 40000


@dataclass(frozen=True)
class SlurmTask:
    job_id: str  # what scontrol requeue takes: SLURM_JOB_ID is unique per array task too
    restart_count: int  # 0 on the first run of the job, k after its k-th requeue
    global_rank: int
    local_rank: int
    node_rank: int
    num_tasks: int
    num_nodes: int
    nodelist: str

    @property
    def label(self) -> str:
        return f"SLURM job {self.job_id} (attempt {self.restart_count}, task {self.global_rank}/{self.num_tasks})"


def current_task(env: Mapping[str, str] | None = None) -> SlurmTask | None:
    """This process as a task of a SLURM job step, or None outside one (a login node, a plain shell)."""
    env = os.environ if env is None else env
    if not all(k in env for k in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")):
        return None
    return SlurmTask(
        job_id=env["SLURM_JOB_ID"],
        restart_count=int(env.get("SLURM_RESTART_COUNT") or 0),
        global_rank=int(env["SLURM_PROCID"]),
        local_rank=int(env.get("SLURM_LOCALID") or 0),
        node_rank=int(env.get("SLURM_NODEID") or 0),
        num_tasks=int(env["SLURM_NTASKS"]),
        num_nodes=int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1),
        nodelist=env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "",
    )


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True, timeout=30).stdout


def node_address(node: str, show_node: Callable[[str], str] | None = None) -> str:
    """An address for SLURM node ``node``: its name if it resolves, else the NodeAddr SLURM reaches it at."""
    try:
        socket.getaddrinfo(node, None)
        return node
    except OSError:
        pass
    record = (show_node or (lambda n: _scontrol("show", "node", n, "-o")))(node)
    for field in record.split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1]
    raise RuntimeError(f"SLURM node '{node}' does not resolve and scontrol shows no NodeAddr for it")


def first_node(nodelist: str, expand: Callable[[str], str] | None = None) -> str:
    """The first host of a compressed node list (``n[1-2]`` -> ``n1``), expanded by SLURM itself."""
    hosts = (expand or (lambda nl: _scontrol("show", "hostnames", nl)))(nodelist).split()
    if not hosts:
        raise RuntimeError(f"scontrol cannot expand the node list '{nodelist}'")
    return hosts[0]


def master_port(job_id: str) -> int:
    """The same port in every task of a job (derived from its id), different across concurrent jobs."""
    digits = "".join(ch for ch in job_id if ch.isdigit()) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def rendezvous_env(task: SlurmTask, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """MASTER_ADDR/MASTER_PORT for ``task``'s job; values the user exported win (their cluster, their rules)."""
    env = os.environ if env is None else env
    out = {}
    if not env.get("MASTER_ADDR"):
        out["MASTER_ADDR"] = node_address(first_node(task.nodelist)) if task.num_nodes > 1 else "127.0.0.1"
    if not env.get("MASTER_PORT"):
        out["MASTER_PORT"] = str(master_port(task.job_id))
    return out


def max_requeues(env: Mapping[str, str] | None = None) -> int:
    """How many times a job may requeue itself (the launcher's ``max_num_timeout``); 0 outside the launcher."""
    env = os.environ if env is None else env
    return int(env.get(MAX_REQUEUES_ENV) or 0)


def requeue(task: SlurmTask) -> None:
    """Put the job back in the queue; SLURM then ends this attempt (SIGTERM, then SIGKILL after KillWait)."""
    _scontrol("requeue", task.job_id)


def record_attempt(run_dir: Path, task: SlurmTask, event: str, **details: object) -> None:
    """Append one line to RUN_DIR/attempts.jsonl: every start, preemption and end of every attempt stays visible."""
    line = {"time": time.time(), "event": event, **asdict(task), **details}
    with (run_dir / ATTEMPTS_FILE).open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(line, default=str) + "\n")
