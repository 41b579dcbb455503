"""A run stopped by a full disk, said as that: where, what was being written, what is kept, how to go on.

When the disk under the run dir fills, every rank fails at once in whatever it was writing (DCP's aggregated
``CheckpointException``, torch's ``inline_container.cc: unexpected pos``, a log handler, a telemetry line), and a
rank that cannot write its crash record reads as one that died: the console ended in ``rank 1 died (exit code 1)``.
The disk itself is the evidence: an error that names ENOSPC (or a quota) while the run dir's filesystem has next
to nothing free. An injected ENOSPC on a disk with room (reliability/faults.py) stays the crash it is.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from disttrain.checkpoint.resume import newest_complete

NO_SPACE = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), "unexpected pos")
# Next to nothing free: under this share of the filesystem and under this many bytes (a 40 MiB tmpfs, a full
# multi-TB volume with a few MiB left both count; a volume with room refused one write does not).
FULL_SHARE = 0.01
FULL_BYTES = 1024**3
PARTIAL = re.compile(r"^\.partial-step(\d+)$")


def error_text(err: BaseException | None) -> str:
    """The error and its causes and contexts, as text (DCP's exception carries each rank's traceback in its own)."""
    parts, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        parts.append(f"{type(err).__name__}: {err}")
        err = err.__cause__ or err.__context__
    return "\n".join(parts)


def disk_is_full(path: Path) -> tuple[bool, int]:
    """(full, free bytes) of the filesystem ``path`` lives on (its nearest existing dir)."""
    where = next((p for p in (path, *path.parents) if p.exists()), path)
    try:
        usage = shutil.disk_usage(where)
    except OSError:
        return False, 0
    return usage.free < min(FULL_BYTES, FULL_SHARE * usage.total), usage.free


def disk_full_failure(err: BaseException | None, run_dir: Path) -> str | None:
    """The one line for a run stopped by a full disk (None: not that): the step whose checkpoint was being written
    (a staging dir left behind), the free space, the newest complete checkpoint and the command that resumes."""
    text = error_text(err)
    if not any(marker in text for marker in NO_SPACE):
        return None
    full, free = disk_is_full(Path(run_dir))
    if not full:
        return None
    ckpt_dir = Path(run_dir) / "checkpoints"
    steps = [int(m.group(1)) for p in ckpt_dir.glob(".partial-step*") if (m := PARTIAL.match(p.name))]
    writing = f"writing the checkpoint of step {max(steps)} " if steps else "writing "
    point = newest_complete(ckpt_dir) if ckpt_dir.is_dir() else None
    kept = f"the newest complete checkpoint is {point.checkpoint.name}" if point else "no complete checkpoint is kept"
    return (
        f"disk full {writing}under {ckpt_dir if steps else run_dir} ({free / 1024**2:.0f} MiB free); {kept}: free "
        f"space or move the run dir, then python -m train resume={run_dir}"
    )
