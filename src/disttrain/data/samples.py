"""Samples in a batch of any structure: the run's unit of work where the module does not say what a token is."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The first tensor of a tensor, tuple/list, mapping or dataclass batch (depth first, in order), else None."""
    if isinstance(batch, torch.Tensor):
        return batch
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        batch = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    elif isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        for item in batch:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def batch_rows(batch: Any) -> int | None:
    """Samples in ``batch``: the leading dimension of its first tensor (the collate convention: one row a sample);
    None where it holds no tensor with a dimension."""
    tensor = first_tensor(batch)
    return int(tensor.shape[0]) if tensor is not None and tensor.dim() > 0 else None


def rows_problem(batch: Any, micro_batch_size: int) -> str | None:
    """What is wrong with a LightningModule's first training batch for the run's accounting, or None: samples are
    counted as its rows, and the batch plan (global batch, accumulation, samples/s) as micro-batches of
    ``trainer.micro_batch_size`` rows."""
    rows = batch_rows(batch)
    if rows is None:
        return f"holds no tensor to count samples from (a {type(batch).__name__})"
    if rows != micro_batch_size:
        return f"holds {rows} samples, and trainer.micro_batch_size={micro_batch_size}"
    return None
