"""A user's datamodule (``data._target_``) is held to the contract the loss and the accounting read: batches of
``(inputs, targets)`` token-id tensors ``[micro_batch, seq_len]``, ids below ``model.vocab_size``.

Its first training batch and its first validation batch are checked on every rank before the model sees them.
Without the check a dict batch failed inside the model with ``'str' object has no attribute 'shape'``, ids past the
vocabulary with an embedding ``IndexError`` (on a GPU a device-side assert), and a shorter sequence trained
silently while tokens/s, MFU and the planner counted ``seq_len``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from disttrain.config.errors import ConfigError
from disttrain.data.samples import rows_problem

# cross_entropy's default ignore_index: a target the loss skips (padding), not a token id.
IGNORED_TARGET = -100
# What reads them takes: the embedding int64 or int32 ids, cross_entropy int64 targets (int32 fails inside the loss).
ID_DTYPES = {"inputs": (torch.int64, torch.int32), "targets": (torch.int64,)}
FIX = (
    "yield (inputs, targets) pairs of int64 token-id tensors [micro_batch_size, model.seq_len] with ids in "
    "[0, model.vocab_size) (docs/configuration.md, 'Your own model or data')"
)


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict (keys {', '.join(map(str, value))})"
    if isinstance(value, torch.Tensor):
        return f"a {list(value.shape)} {str(value.dtype).removeprefix('torch.')} tensor"
    return f"a {type(value).__name__}"


def batch_problem(batch: Any, seq_len: int, micro_batch: int, vocab_size: int) -> str | None:
    """What is wrong with ``batch`` for a run of this shape, or None."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        return f"is {_describe(batch)}, not an (inputs, targets) pair"
    inputs, targets = batch
    for name, part in (("inputs", inputs), ("targets", targets)):
        if not isinstance(part, torch.Tensor):
            return f"holds {_describe(part)} as its {name}, not a tensor"
        if part.dtype not in ID_DTYPES[name]:
            allowed = " or ".join(str(d).removeprefix("torch.") for d in ID_DTYPES[name])
            return f"holds {_describe(part)} as its {name}, not token ids ({allowed})"
    if inputs.dim() != 2 or inputs.shape != targets.shape:
        return f"holds inputs {list(inputs.shape)} and targets {list(targets.shape)}, not two [batch, seq] tensors"
    rows, columns = inputs.shape
    if columns != seq_len:
        return f"has sequences of {columns} tokens, not model.seq_len={seq_len}"
    if rows > micro_batch:
        return f"has {rows} rows, more than the micro-batch of {micro_batch} the datamodule was given"
    low, high = int(inputs.min()), int(inputs.max())
    if low < 0 or high >= vocab_size:
        return f"holds input ids in [{low}, {high}], outside [0, model.vocab_size={vocab_size})"
    kept = targets[targets != IGNORED_TARGET]
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= vocab_size):
        return f"holds target ids in [{int(kept.min())}, {int(kept.max())}], outside [0, model.vocab_size={vocab_size})"
    return None


class UserBatchCheck(pl.Callback):
    """Checks the first training and the first validation batch of a user's datamodule (once each)."""

    def __init__(self, seq_len: int, micro_batch: int, vocab_size: int) -> None:
        self.shape = (seq_len, micro_batch, vocab_size)
        self.checked: set[str] = set()

    def _check(self, loader: str, batch: Any) -> None:
        if loader in self.checked:
            return
        self.checked.add(loader)
        if (problem := batch_problem(batch, *self.shape)) is not None:
            raise ConfigError("data._target_", f"the first {loader} batch {problem}", FIX)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        self._check("training", batch)

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any
    ) -> None:
        self._check("validation", batch)


class ModuleBatchCheck(pl.Callback):
    """A LightningModule's first training batch (any structure): its rows are the micro-batch the run planned; and
    its first ``training_step``, under automatic optimization, returned a loss (Lightning skips the optimizer step of
    a step that returns None: a module that always does trains nothing, silently)."""

    def __init__(self, micro_batch: int) -> None:
        self.micro_batch = micro_batch
        self.checked = False
        self.output_checked = False

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        if self.output_checked:
            return
        self.output_checked = True
        if pl_module.automatic_optimization and outputs is None:
            raise ConfigError(
                "model._target_",
                f"{type(pl_module).__name__}.training_step returned None under automatic optimization: Lightning "
                "then skips the optimizer step, and nothing trains",
                "return the loss (or a dict with a 'loss' key) from training_step",
            )

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        if self.checked:
            return
        self.checked = True
        if (problem := rows_problem(batch, self.micro_batch)) is not None:
            raise ConfigError(
                "trainer.micro_batch_size",
                f"the first training batch {problem}",
                "set trainer.micro_batch_size to your loader's batch size (or give your datamodule a batch_size "
                "argument: the run passes trainer.micro_batch_size to it)",
            )
