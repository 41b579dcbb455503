"""The run's configuration as the recommendations need it: current values by dotted key, in Hydra syntax.

Read from ``run.json`` (the resolved config and the batch plan); every accessor returns None when the manifest
is absent, so recommendations degrade to generic values instead of failing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from diagnostics.analysis.load import RunTelemetry


def hydra_value(value: Any) -> str:
    """A Python value in Hydra override syntax (bools lower-case, None as null, odd strings quoted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):  # Hydra's list syntax, without spaces: one shell word
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    text = str(value)
    if re.fullmatch(r"[A-Za-z0-9_./:+-]+", text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _lever_keys(levers: list[dict[str, Any]] | None) -> frozenset[str] | None:
    if levers is None:
        return None
    return frozenset(str(entry["key"]) for entry in levers if isinstance(entry, dict) and "key" in entry)


@dataclass(frozen=True)
class RunContext:
    """The current values the recommendations change, read from run.json (empty when it is absent)."""

    config: dict[str, Any]
    batch: dict[str, Any]
    cpu_count: int | None
    num_threads: int | None = None  # torch intra-op threads per rank (meta; not in every collector version)
    ranks_per_host: int | None = None  # ranks that reported the same hostname
    work: dict[str, Any] | None = None  # run.json's unit of work and module kind (a user's LightningModule or not)
    # The config keys the run's trainer takes as levers (run.json's catalogue); None for a run dir recorded before
    # the trainer wrote one, where nothing is checked against it.
    lever_keys: frozenset[str] | None = None

    @classmethod
    def from_run(cls, run: RunTelemetry) -> RunContext:
        manifest = run.manifest
        cpus = run.meta("cpu_count")  # of the training host; not in every collector version
        threads = run.meta("num_threads")
        hosts: dict[str, int] = {}
        for tele in run.ranks.values():
            if isinstance(host := (tele.meta or {}).get("hostname"), str):
                hosts[host] = hosts.get(host, 0) + 1
        return cls(
            manifest.config if manifest is not None else {},
            manifest.batch if manifest is not None and isinstance(manifest.batch, dict) else {},
            cpus if isinstance(cpus, int) else None,
            threads if isinstance(threads, int) and not isinstance(threads, bool) else None,
            max(hosts.values()) if hosts else None,
            manifest.work if manifest is not None else None,
            _lever_keys(manifest.levers if manifest is not None else None),
        )

    def host_cores_busy(self) -> bool | None:
        """Whether a CPU run's compute threads already occupy every core of the host (None: unknown).

        Then communication has no idle core to run on while compute runs: overlapping it (smaller buckets,
        prefetching) cannot shorten the step, and overlapped communication slows the compute it shares cores
        with. Threads default to cores // local ranks (trainer.num_threads: null), which fills the host.
        """
        if self.on_gpu or self.get("hw.accelerator") not in (None, "cpu") or not self.cpu_count:
            return None
        threads = self.num_threads or self.get("trainer.num_threads")
        ranks = self.ranks_per_host or self.local_ranks()
        if not isinstance(threads, int):
            threads = max(1, self.cpu_count // ranks)
        return threads * ranks >= self.cpu_count

    @property
    def lightning_module(self) -> bool:
        """A user's own LightningModule: its optimizer, schedule and layers are its own, not the config's."""
        return bool((self.work or {}).get("lightning_module"))

    @property
    def manual_optimization(self) -> bool:
        return (self.work or {}).get("automatic_optimization") is False

    def get(self, dotted: str) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def has(self, dotted: str) -> bool:
        parent, _, leaf = dotted.rpartition(".")
        node = self.get(parent) if parent else self.config
        return isinstance(node, dict) and leaf in node

    @property
    def strategy(self) -> str | None:
        return self.get("strategy.name")

    @property
    def zero3(self) -> bool:
        """DeepSpeed ZeRO-3: parameters partitioned, each module's gathered before its forward and its backward."""
        return self.strategy == "deepspeed" and self.get("strategy.stage") == 3

    @property
    def on_gpu(self) -> bool:
        return self.get("hw.accelerator") == "gpu"

    def local_ranks(self) -> int:
        return self.get("hw.devices_per_node") or 1

    def micro(self) -> int | None:
        return self.batch.get("micro_batch_size") or self.get("trainer.micro_batch_size")

    def global_batch(self) -> int | None:
        if self.batch.get("global_batch_size"):
            return self.batch["global_batch_size"]
        micro, dp = self.micro(), self.batch.get("data_parallel_size")
        return micro * dp if micro and dp else self.get("trainer.global_batch_size")

    def current(self, key: str) -> tuple[bool, Any]:
        """(known, value) of an override key: a group (``strategy``) by its option name, else the dotted value."""
        key = key.lstrip("+~")
        if "." not in key and isinstance(self.config.get(key), dict):
            return "name" in self.config[key], self.config[key].get("name")
        return self.has(key), self.get(key)
