"""A user's datamodule (``data._target_``), found and called as the ranks will call it: checked as the job starts,
before any rank builds it (job/run.py; not in preflight, which must not import torch: launch/fork.py)."""

from __future__ import annotations

import inspect

from disttrain.config.errors import ConfigError
from disttrain.config.schema import CustomDataConfig
from disttrain.models.factory import resolve_target


def datamodule_arguments(data: CustomDataConfig, seq_len: int, micro_batch_size: int) -> dict[str, object]:
    """What the class is called with: the run's sequence length and micro-batch, then the other ``data.*`` keys."""
    return {"seq_len": seq_len, "micro_batch_size": micro_batch_size, **data.kwargs}


def check_user_datamodule(data: CustomDataConfig, seq_len: int, micro_batch_size: int) -> None:
    """Import the class and bind the call's arguments to its signature (nothing is constructed: a datamodule may
    download or read files in its constructor), so a wrong dotted path or keyword fails in one line before training."""
    cls = resolve_target(data.target, "data._target_")
    if not callable(cls):
        raise ConfigError("data._target_", f"'{data.target}' is a {type(cls).__name__}", "name a LightningDataModule")
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a builtin or C type without one: the call itself will tell
        return
    try:
        signature.bind(**datamodule_arguments(data, seq_len, micro_batch_size))
    except TypeError as err:
        raise ConfigError(
            "data._target_",
            f"{data.target}(seq_len=..., micro_batch_size=..., <data.* keys>) does not fit its signature: {err}",
            "accept seq_len and micro_batch_size keyword arguments (or **kwargs), and give data only the keys it takes",
        ) from None
