"""What a run's logger wrote, read back the way a user's tool would: TensorBoard event files through
TensorBoard's own reader, an offline wandb run's history from its ``.wandb`` file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

# The ``.wandb`` file is a LevelDB-style log: a 7-byte file header, then 32 KiB blocks of records, each with a
# 7-byte header (crc32, length, type); a record that does not fit a block is split FIRST/MIDDLE/LAST.
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def tensorboard_scalars(log_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[str]]]:
    """Every scalar series (tag -> [(step, value)]) and text (tag -> [text]) of the event files in ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags["scalars"]}
    texts = {
        tag: [b.decode() for e in events.Tensors(tag) for b in e.tensor_proto.string_val] for tag in tags["tensors"]
    }
    return scalars, texts


def _wandb_records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    records, pending, offset = [], b"", 7
    while offset + 7 <= len(data):
        left_in_block = _BLOCK - offset % _BLOCK
        if left_in_block < 7:  # block trailer padding
            offset += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        body = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind == _FULL:
            records.append(body)
        elif kind == _FIRST:
            pending = body
        elif kind == _MIDDLE:
            pending += body
        elif kind == _LAST:
            records.append(pending + body)
        else:  # zero padding at the end of a file still being written
            break
    return records


def wandb_history(offline_run: Path) -> list[dict[str, object]]:
    """The rows an offline wandb run logged (``wandb.log``), each a dict of key -> value."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in offline_run.glob("*.wandb"):
        for raw in _wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows
