"""Token streams from files, and the fixed-stride windows a language model trains on.

The readers turn every user mistake (missing, empty or malformed file, token ids beyond the vocab, a split too
short for one window) into a ``ConfigError`` naming the key and the fix, before any process starts.
"""

from __future__ import annotations

import math
import mmap
import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from disttrain.config.errors import ConfigError

RANGE_CHECK_TOKENS = 4 * 1024 * 1024  # enough to catch a wrong tokenizer without reading a multi-GB file whole


class WindowDataset(Dataset):
    """Non-overlapping ``seq_len`` windows of a ``[rows, length]`` token array (or a 1-D stream as one row).

    Window i of a row starts at ``i * seq_len``: ``x = row[o:o+T]``, ``y = row[o+1:o+T+1]``, so every token after
    a row's first is a target exactly once and no window crosses rows. Items are int64 tensors; a memmap is read
    one window at a time and is reopened (not copied) when the dataset is pickled into a worker process.
    """

    def __init__(self, data: np.ndarray, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not np.issubdtype(data.dtype, np.integer):
            raise TypeError(f"WindowDataset needs integer tokens, got dtype {data.dtype}")
        if data.ndim == 1:
            data = data.reshape(1, -1)
        if data.ndim != 2:
            raise ValueError(f"WindowDataset needs a 1-D stream or a 2-D [rows, length] array, got {data.ndim}-D")
        self.data = data
        self.seq_len = seq_len
        self.windows_per_row = (data.shape[1] - 1) // seq_len if data.shape[1] > 0 else 0
        if self.windows_per_row == 0 or data.shape[0] == 0:
            raise ValueError(
                f"rows of {data.shape[1]} tokens hold no window of seq_len + 1 = {seq_len + 1} tokens "
                f"(array shape {tuple(data.shape)})"
            )

    def __len__(self) -> int:
        return self.data.shape[0] * self.windows_per_row

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError(f"window {index} out of range for {size} windows")
        row, start = divmod(index, self.windows_per_row)
        start *= self.seq_len
        chunk = torch.from_numpy(np.array(self.data[row, start : start + self.seq_len + 1], dtype=np.int64))
        return chunk[:-1].clone(), chunk[1:].clone()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        spec = _memmap_spec(self.data)
        if spec is not None:
            # Pickling an np.memmap copies its whole contents; a spawned worker reopens the file instead.
            state["data"] = None
            state["_memmap_spec"] = spec
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        spec = state.pop("_memmap_spec", None)
        self.__dict__.update(state)
        if spec is not None:
            filename, dtype, offset, shape = spec
            self.data = np.memmap(filename, dtype=dtype, mode="r", offset=offset, shape=shape)


def _memmap_spec(data: np.ndarray) -> tuple[str, str, int, tuple[int, ...]] | None:
    """(file, dtype, byte offset, shape) that reopen ``data`` when it is a C-contiguous view of a memmap."""
    buffer = getattr(data, "_mmap", None)  # numpy keeps the mapping on every view of a memmap
    if not isinstance(data, np.memmap) or data.filename is None or buffer is None or not data.flags.c_contiguous:
        return None
    try:
        mapped_start = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
    except (TypeError, ValueError):
        return None
    # np.memmap maps the file from the offset rounded down to the allocation granularity.
    file_start = data.offset - data.offset % mmap.ALLOCATIONGRANULARITY
    offset = file_start + data.ctypes.data - mapped_start
    return str(data.filename), data.dtype.str, offset, tuple(data.shape)


def read_text_bytes(path: str) -> np.ndarray:
    """The bytes of a text file as a uint8 array (byte-level tokens, vocab 256)."""
    fix = "point data.path at an existing non-empty text file"
    full = os.path.expanduser(path)
    if not os.path.exists(full):
        raise ConfigError("data.path", f"file '{path}' does not exist", fix)
    if os.path.isdir(full):
        raise ConfigError("data.path", f"'{path}' is a directory, not a file", fix)
    try:
        data = np.fromfile(full, dtype=np.uint8)
    except OSError as err:
        raise ConfigError("data.path", f"file '{path}' cannot be read ({err.strerror or err})", fix) from err
    if data.size == 0:
        raise ConfigError("data.path", f"file '{path}' is empty", fix)
    return data


def open_token_file(path: str, key: str) -> np.memmap:
    """A read-only uint16 memmap of a flat nanoGPT-style token file."""
    fix = f"point {key} at an existing non-empty .bin file of uint16 token ids (np.array(ids, np.uint16).tofile(path))"
    full = os.path.expanduser(path)
    if not os.path.exists(full):
        raise ConfigError(key, f"token file '{path}' does not exist", fix)
    if os.path.isdir(full):
        raise ConfigError(key, f"'{path}' is a directory, not a token file", fix)
    size = os.path.getsize(full)
    if size == 0:
        raise ConfigError(key, f"token file '{path}' is empty", fix)
    if size % 2:
        raise ConfigError(key, f"token file '{path}' has {size} bytes, an odd number, so it is not flat uint16", fix)
    try:
        return np.memmap(full, dtype=np.uint16, mode="r")
    except OSError as err:
        raise ConfigError(key, f"token file '{path}' cannot be read ({err.strerror or err})", fix) from err


def check_token_range(tokens: np.ndarray, vocab_size: int, key: str) -> None:
    """Fail if a token id in the first 4M tokens is outside ``[0, vocab_size)``."""
    head = tokens.reshape(-1)[:RANGE_CHECK_TOKENS]
    if head.size == 0:
        return
    largest = int(head.max())
    if largest >= vocab_size:
        raise ConfigError(
            key,
            f"token id {largest} (in the first {head.size} tokens) is >= the vocab size {vocab_size}",
            f"set the vocab size to at least {largest + 1}, or use tokens of a tokenizer with at most {vocab_size} ids",
        )
    smallest = int(head.min())
    if smallest < 0:
        raise ConfigError(key, f"token id {smallest} is negative", "use non-negative token ids")


def split_stream(stream: np.ndarray, val_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): the head and the tail holding ``val_fraction`` of the tokens (views, no copy)."""
    key = "data.val_fraction"
    if not 0 < val_fraction < 1:
        raise ConfigError(key, f"{val_fraction} is not strictly between 0 and 1", "set data.val_fraction to e.g. 0.05")
    total = stream.shape[0]
    num_val = _val_tokens(total, val_fraction)
    need = seq_len + 1
    if num_val < need or total - num_val < need:
        enough = max(math.ceil(need / val_fraction), math.ceil(need / (1 - val_fraction)))
        while _val_tokens(enough, val_fraction) < need or enough - _val_tokens(enough, val_fraction) < need:
            enough += 1  # rounding of the split can leave one part a token short of the estimate
        fix = f"use data with at least {enough} tokens at this val_fraction"
        low, high = math.ceil(need / total * 1e4) / 1e4, math.floor((1 - need / total) * 1e4) / 1e4
        if low <= high:
            fix += f", or set data.val_fraction between {low} and {high}"
        fix += ", or a shorter seq_len"
        raise ConfigError(
            key,
            f"splitting {total} tokens at {val_fraction} gives {total - num_val} train and {num_val} val tokens, "
            f"but each part needs at least seq_len + 1 = {need} tokens",
            fix,
        )
    return stream[: total - num_val], stream[total - num_val :]


def _val_tokens(total: int, val_fraction: float) -> int:
    return round(total * val_fraction)
