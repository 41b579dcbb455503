"""Checkpoint files on disk: names, atomic publication, completeness, discovery and retention.

Strategy-neutral on purpose: a checkpoint is either one file (DDP: ``torch.save`` zip) or one directory
(FSDP2: a torch.distributed.checkpoint dir; DeepSpeed: its engine's dir), possibly with sidecars a strategy
derives from its path (``step000010.powersgd/`` next to ``step000010.ckpt``). Every save goes to a hidden
staging dir (``.partial-step000010/step000010.ckpt`` and its sidecars); once every rank has finished writing,
the sidecars and then the checkpoint are renamed into place, so a name matching ``step<N>.ckpt`` means
"complete". A kill during a save leaves only the staging dir, which discovery ignores and the next save removes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

STEP_CHECKPOINT = re.compile(r"^step(\d+)\.ckpt$")
PARTIAL_PREFIX = ".partial-"
PARTIAL_CHECKPOINT = re.compile(r"^\.partial-step(\d+)$")
LAST_LINK = "last.ckpt"
# A directory checkpoint is complete once its writer's index exists: ``.metadata`` is written last by
# torch.distributed.checkpoint (after every rank's shards), ``latest`` by DeepSpeed's save_checkpoint.
DIR_COMPLETE_MARKERS = (".metadata", "latest")
# The size of every file of a directory checkpoint, recorded once every rank has written its part: a shard cut
# short or lost afterwards (a full disk, a partial copy) makes the checkpoint incomplete, not a failed resume.
SIZES_FILE = ".disttrain-sizes.json"


def checkpoint_name(step: int) -> str:
    return f"step{step:06d}.ckpt"


def staging_dir(ckpt_dir: Path, step: int) -> Path:
    """Where step ``step``'s checkpoint is written before it is published; the same on every rank."""
    return ckpt_dir / f"{PARTIAL_PREFIX}step{step:06d}"


def artifacts_of(ckpt_dir: Path, name: str) -> list[Path]:
    """The checkpoint ``name`` and its sidecars (``step000010.ckpt``, ``step000010.powersgd``, ...)."""
    stem = name.removesuffix(".ckpt")
    return [p for p in ckpt_dir.glob(f"{stem}.*") if p.name == name or p.name.split(".")[0] == stem]


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds a whole checkpoint (a truncated zip or a dir without its index does not)."""
    if path.is_dir():
        return any((path / marker).exists() for marker in DIR_COMPLETE_MARKERS) and sizes_match(path)
    # torch.save writes a zip whose central directory is at the end: a cut-off file has none.
    return path.is_file() and zipfile.is_zipfile(path)


def record_sizes(checkpoint: Path) -> None:
    """Record the size of every file of a directory checkpoint in it (nothing for a file checkpoint)."""
    if not checkpoint.is_dir():
        return
    sizes = {str(f.relative_to(checkpoint)): f.stat().st_size for f in sorted(checkpoint.rglob("*")) if f.is_file()}
    (checkpoint / SIZES_FILE).write_text(json.dumps(sizes, indent=1) + "\n", encoding="utf-8")


def sizes_match(checkpoint: Path) -> bool:
    """Every file recorded by ``record_sizes`` is there with its size (a checkpoint without the record: True)."""
    try:
        sizes = json.loads((checkpoint / SIZES_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return True  # written before the record existed
    except (OSError, ValueError):
        return False
    for name, size in sizes.items():
        try:
            if (checkpoint / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def remove_path(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def _replace(source: Path, target: Path) -> None:
    if target.is_dir() and not target.is_symlink():
        # os.replace cannot replace a non-empty directory: move the old one aside first (it is superseded).
        stale = target.with_name(f".{target.name}.replaced")
        remove_path(stale)
        os.replace(target, stale)
        os.replace(source, target)
        remove_path(stale)
    else:
        os.replace(source, target)


def publish(staging: Path, ckpt_dir: Path, name: str) -> Path:
    """Move a fully written checkpoint from ``staging`` into ``ckpt_dir``: sidecars first, the checkpoint last.

    Each rename is atomic; the checkpoint's own name appearing is what marks the whole save complete.
    """
    for item in sorted(staging.iterdir(), key=lambda p: p.name == name):
        _replace(item, ckpt_dir / item.name)
    staging.rmdir()
    return ckpt_dir / name


def relink_last(ckpt_dir: Path, target_name: str) -> None:
    """Point ``last.ckpt`` at ``target_name`` atomically (a relative symlink survives copying the run dir)."""
    tmp = ckpt_dir / f".last.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target_name)
    os.replace(tmp, ckpt_dir / LAST_LINK)


def remove_partials(ckpt_dir: Path) -> list[Path]:
    """Delete leftovers of interrupted saves (staging dirs); returns what was removed."""
    removed = list(ckpt_dir.glob(f"{PARTIAL_PREFIX}*"))
    for path in removed:
        remove_path(path)
    return removed


@dataclass(frozen=True)
class Discovery:
    """What a checkpoint directory holds: complete checkpoints by step, and what was passed over and why."""

    complete: list[tuple[int, Path]] = field(default_factory=list)  # ascending by step
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (step, "step000014.ckpt (incomplete)")

    @property
    def newest(self) -> tuple[int, Path] | None:
        return self.complete[-1] if self.complete else None


def discover(ckpt_dir: Path) -> Discovery:
    """Every complete ``step<N>.ckpt`` in ``ckpt_dir``; incomplete ones and interrupted saves are listed as skipped."""
    complete: list[tuple[int, Path]] = []
    skipped: list[tuple[int, str]] = []
    if not ckpt_dir.is_dir():
        return Discovery()
    for path in ckpt_dir.iterdir():
        if match := STEP_CHECKPOINT.match(path.name):
            if is_complete(path):
                complete.append((int(match.group(1)), path))
            else:
                skipped.append((int(match.group(1)), f"{path.name} (incomplete)"))
        elif match := PARTIAL_CHECKPOINT.match(path.name):
            skipped.append((int(match.group(1)), f"{path.name} (interrupted save)"))
    complete.sort()
    skipped.sort()
    return Discovery(complete, skipped)


def to_delete_for_retention(discovery: Discovery, keep_last_n: int | None) -> list[Path]:
    """Complete checkpoints beyond the newest ``keep_last_n`` (with their sidecars); never the newest one."""
    if keep_last_n is None or keep_last_n < 1:
        return []
    old = [path for _, path in discovery.complete[:-keep_last_n]]
    # The checkpoint itself goes first: a kill half-way leaves stray sidecars, never a checkpoint without them.
    return [item for path in old for item in sorted(artifacts_of(path.parent, path.name), key=lambda p: p != path)]
