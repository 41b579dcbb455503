"""A user's datamodule (``data._target_``), found and called as the ranks will call it: checked as the job starts,
before any rank builds it (job/run.py; not in preflight, which must not import torch: launch/fork.py).

A token model's datamodule is called with the run's ``seq_len`` and ``micro_batch_size``; a LightningModule's with
``batch_size=trainer.micro_batch_size`` where its signature names a ``batch_size`` (the run plans its global batch,
accumulation and samples/s from that micro-batch), and otherwise with its own ``data.*`` keys alone.
"""

from __future__ import annotations

import inspect

from disttrain.config.errors import ConfigError
from disttrain.config.schema import CustomDataConfig
from disttrain.models.targets import resolve_target


def takes_batch_size(cls: object) -> bool:
    try:
        parameters = inspect.signature(cls).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return "batch_size" in parameters and parameters["batch_size"].kind in kinds


def datamodule_arguments(data: CustomDataConfig, micro_batch_size: int, seq_len: int | None) -> dict[str, object]:
    """What the class is called with. ``seq_len`` None: a LightningModule's data (see the module docstring)."""
    if seq_len is not None:
        return {"seq_len": seq_len, "micro_batch_size": micro_batch_size, **data.kwargs}
    if "batch_size" not in data.kwargs and takes_batch_size(resolve_target(data.target, "data._target_")):
        return {"batch_size": micro_batch_size, **data.kwargs}
    return dict(data.kwargs)


def describe_batch_size(data: CustomDataConfig, micro_batch_size: int) -> str:
    """The console's line on where a LightningModule's datamodule gets its batch size."""
    cls = resolve_target(data.target, "data._target_")
    name = data.target.rsplit(".", 1)[-1]
    if takes_batch_size(cls):
        return f"data: {name}(batch_size={micro_batch_size}) from trainer.micro_batch_size"
    return (
        f"data: {name} takes no batch_size argument: its loaders decide the batch size, and samples are counted from "
        f"its batches (trainer.micro_batch_size={micro_batch_size} does not reach it)"
    )


def defines_train_dataloader(cls: object) -> bool:
    """A LightningDataModule whose ``train_dataloader`` is its own (the inherited one raises "must be implemented"
    only once fit asks for it); anything else is taken at its word."""
    import lightning.pytorch as pl

    if not (inspect.isclass(cls) and issubclass(cls, pl.LightningDataModule)):
        return True
    return getattr(cls, "train_dataloader", None) is not pl.LightningDataModule.train_dataloader


def check_user_datamodule(data: CustomDataConfig, micro_batch_size: int, seq_len: int | None) -> None:
    """Import the class and bind the call's arguments to its signature (nothing is constructed: a datamodule may
    download or read files in its constructor), so a wrong dotted path or keyword fails in one line before training."""
    cls = resolve_target(data.target, "data._target_")
    if not callable(cls):
        raise ConfigError("data._target_", f"'{data.target}' is a {type(cls).__name__}", "name a LightningDataModule")
    if not defines_train_dataloader(cls):
        raise ConfigError(
            "data._target_",
            f"{data.target} has no train_dataloader()",
            "name a LightningDataModule that defines train_dataloader() (and val_dataloader() to validate)",
        )
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a builtin or C type without one: the call itself will tell
        return
    try:
        signature.bind(**datamodule_arguments(data, micro_batch_size, seq_len))
    except TypeError as err:
        if seq_len is None:
            problem = f"{data.target}(<data.* keys>) does not fit its signature: {err}"
            fix = "give data only the keys its constructor takes"
        else:
            problem = (
                f"{data.target}(seq_len=..., micro_batch_size=..., <data.* keys>) does not fit its signature: {err}"
            )
            fix = (
                "accept seq_len and micro_batch_size keyword arguments (or **kwargs), and give data only the keys it "
                "takes"
            )
        raise ConfigError("data._target_", problem, fix) from None
