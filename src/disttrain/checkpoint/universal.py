"""The one checkpoint layout every strategy writes and reads: single-process names, resharded on load.

A checkpoint ``step<N>.ckpt`` is a torch.distributed.checkpoint (DCP) directory holding

* ``state_dict.<name>``: the model's tensors under the names one process gives them (``model.blocks.0.attn.wq.weight``),
  whatever the strategy: DDP replicas, FSDP2/TP DTensor shards, Megatron pipeline stages, DeepSpeed ZeRO partitions;
* ``optimizer_<i>.state.<name>.<key>`` and ``optimizer_<i>.param_groups.<name>.<key>``: the optimizer's state and
  hyper-parameters keyed by parameter name (torch's "flattened" optimizer state dict), so neither parameter order nor
  the optimizer's partitioning is baked in;
* ``meta.pt``: everything else Lightning saves (loops, lr schedulers, callbacks: the data position and per-rank RNG
  states), plus ``FORMAT_KEY`` naming the writer (strategy, world size).

On load, DCP reads each tensor into whatever this run holds for that name (a full tensor, a DTensor shard, a ZeRO
partition's full view), so the same checkpoint resumes under any strategy and world size. Model and optimizer entries
are read into templates the running strategy builds; ``read_into`` checks the templates against the checkpoint's
index first, so a missing tensor is named instead of failing deep inside DCP.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from disttrain.checkpoint.compat import META_FILE  # Lightning's name for the non-tensor part

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

MODEL_KEY = "state_dict"
FORMAT_KEY = "disttrain_checkpoint"
FORMAT = "universal-1"
STATE = "state"
PARAM_GROUPS = "param_groups"


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def is_universal(path: Path) -> bool:
    """Whether ``path`` is a checkpoint in this layout (a DCP dir with the model under ``state_dict``).

    FSDP2 and Megatron checkpoints written before the layout was shared qualify too: they already used it."""
    return path.is_dir() and (path / ".metadata").is_file() and (path / META_FILE).is_file()


def saved_keys(path: Path) -> dict[str, Any]:
    """The checkpoint's index: every flattened key (``state_dict.model.x``) and its metadata (``.size`` for tensors)."""
    from torch.distributed.checkpoint import FileSystemReader

    return dict(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def writer_of(path: Path) -> dict[str, Any]:
    """What wrote a universal checkpoint: ``{"format", "strategy", "world_size"}`` ({} for an older one)."""
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
    return dict(meta.get(FORMAT_KEY, {}))


def save(
    path: Path,
    model_state: dict[str, Any],
    optimizer_states: list[dict[str, Any]],
    meta: dict[str, Any],
    is_global_zero: bool,
) -> None:
    """Write one checkpoint (a collective: every rank calls it with its own part of the state)."""
    import torch.distributed.checkpoint as dcp

    path.mkdir(parents=True, exist_ok=True)
    tensors = {MODEL_KEY: model_state, **{optimizer_key(i): s for i, s in enumerate(optimizer_states)}}
    dcp.save(tensors, checkpoint_id=path)
    if is_global_zero:
        torch.save(meta, path / META_FILE)


def read_model(path: Path) -> dict[str, torch.Tensor]:
    """The model's tensors (``model.<name>``, full size, CPU) in this one process; the optimizer stays on disk."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    head = f"{MODEL_KEY}."
    template = {
        key[len(head) :]: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in saved_keys(path).items()
        if key.startswith(head) and isinstance(meta, TensorStorageMetadata)
    }
    request = {MODEL_KEY: template}
    with warnings.catch_warnings():  # DCP warns that it reads "in a single process", which is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(request, checkpoint_id=path, no_dist=True)
    return request[MODEL_KEY]


def read_meta(path: Path, weights_only: bool | None = None) -> dict[str, Any]:
    return torch.load(path / META_FILE, map_location="cpu", weights_only=True if weights_only is None else weights_only)


class MissingState(RuntimeError):
    """The checkpoint lacks a tensor this run needs (a different model, or an optimizer of another kind)."""


def _index_keys(prefix: str, state: dict[str, Any]) -> Iterable[tuple[str, str]]:
    return ((key, f"{prefix}.{key}") for key in state)


def read_into(
    path: Path,
    model_state: dict[str, Any] | None,
    optimizer_states: list[dict[str, Any]],
    index: dict[str, Any] | None = None,
    twins: dict[str, str] | None = None,
) -> None:
    """Fill the templates in place from the checkpoint (a collective).

    Optimizer hyper-parameters the checkpoint lacks (an optimizer class with other group options, e.g. DeepSpeed's
    CPU Adam) keep this run's values; a missing model or optimizer *tensor* is an error naming it. ``twins`` maps a
    parameter this run holds separately to the one a single process shares it with (a pipeline's last stage keeps
    its own copy of the tied ``lm_head.weight``, which one process optimizes as ``tok_emb.weight``): its optimizer
    entries are read from the twin's when the checkpoint has none of its own.
    """
    import torch.distributed.checkpoint as dcp

    index = saved_keys(path) if index is None else index
    request: dict[str, Any] = {}
    if model_state is not None:
        _check_present(index, MODEL_KEY, model_state)
        request[MODEL_KEY] = model_state
    renamed: list[dict[str, str]] = []
    for i, state in enumerate(optimizer_states):
        prefix = optimizer_key(i)
        aliases = twin_keys(state, set(index), prefix, twins or {})
        renamed.append(aliases)
        present = {aliases.get(k, k): v for k, v in state.items() if f"{prefix}.{aliases.get(k, k)}" in index}
        dropped = {k for k in state if aliases.get(k, k) not in present}
        lost = sorted(k for k in dropped if not k.startswith(f"{PARAM_GROUPS}."))
        if lost:
            raise MissingState(
                f"the checkpoint has no optimizer state '{lost[0]}' ({len(lost)} missing): it was saved with another "
                "optimizer; resume with resume_weights_only=true to start the optimizer afresh"
            )
        request[prefix] = present
    dcp.load(request, checkpoint_id=path)
    for i, state in enumerate(optimizer_states):
        loaded = request[optimizer_key(i)]
        for key in state:  # non-tensor values are replaced, not filled in place
            source = renamed[i].get(key, key)
            if source in loaded:
                state[key] = loaded[source] if source == key else _copy(loaded[source])


def _copy(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value


def twin_keys(state: dict[str, Any], index: set[str], prefix: str, twins: dict[str, str]) -> dict[str, str]:
    """Optimizer keys of a twin parameter the checkpoint lacks, mapped to the key of the parameter it twins."""
    out: dict[str, str] = {}
    for key in state:
        for own, other in twins.items():
            for part in (STATE, PARAM_GROUPS):
                head = f"{part}.{own}."
                if key.startswith(head) and f"{prefix}.{key}" not in index:
                    out[key] = f"{part}.{other}.{key[len(head) :]}"
    return out


def _check_present(index: dict[str, Any], prefix: str, state: dict[str, Any]) -> None:
    missing = [key for key, flat in _index_keys(prefix, state) if flat not in index]
    if missing:
        raise MissingState(
            f"the checkpoint has no '{missing[0]}' ({len(missing)} of this model's {len(state)} tensors missing): "
            "it was saved from another model"
        )


def flat_optimizer_options(**extra: bool) -> StateDictOptions:
    """Optimizer state keyed by parameter name (torch's flattened layout), on the CPU while it is written."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True, **extra)
