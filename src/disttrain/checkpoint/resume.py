"""``resume=<run_dir>``: find the checkpoint to continue from and the overrides the run was started with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from disttrain.checkpoint.files import discover, is_complete
from disttrain.config.errors import ConfigError


def run_dir_of(path: Path) -> Path:
    """The run directory a resume path points into (the path itself, or the parent of checkpoints/)."""
    if path.name == "checkpoints" or path.parent.name == "checkpoints":
        return path.parent if path.name == "checkpoints" else path.parent.parent
    return path


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint to continue from, and the newer ones that were passed over (incomplete saves)."""

    checkpoint: Path
    skipped: tuple[str, ...] = ()

    def describe(self) -> str:
        line = f"resuming from {self.checkpoint}"
        if self.skipped:
            line += f" (the newest complete checkpoint; skipped {', '.join(self.skipped)})"
        return line


def newest_complete(ckpt_dir: Path) -> ResumePoint | None:
    """The newest complete ``step<N>.ckpt`` in ``ckpt_dir`` (by step, not by ``last.ckpt``), or None."""
    found = discover(ckpt_dir)
    if found.newest is None:
        return None
    step, path = found.newest
    # Only what is newer than the chosen one was really passed over; older leftovers are just noise.
    return ResumePoint(path.resolve(), tuple(label for s, label in found.skipped if s > step))


def find_resume_point(resume: str) -> ResumePoint:
    """``resume`` may be a run dir, its ``checkpoints/`` dir, or one checkpoint (file, or DCP directory)."""
    path = Path(resume).expanduser()
    if not path.exists():
        raise ConfigError("resume", f"'{resume}' does not exist", "point resume at a run dir under outputs/")
    if path.name.endswith(".ckpt") and path.name != "last.ckpt":
        if not is_complete(path):
            raise ConfigError(
                "resume",
                f"'{resume}' is not a complete checkpoint (cut off during its save, or not a checkpoint)",
                f"point resume at the run dir ({run_dir_of(path)}) to use its newest complete checkpoint",
            )
        return ResumePoint(path.resolve())
    ckpt_dir = path if path.name == "checkpoints" else path.parent if path.name == "last.ckpt" else path / "checkpoints"
    point = newest_complete(ckpt_dir)
    if point is None:
        found = discover(ckpt_dir)
        labels = ", ".join(label for _, label in found.skipped)
        incomplete = f" (only incomplete ones: {labels})" if labels else ""
        raise ConfigError(
            "resume",
            f"no checkpoint found in '{ckpt_dir}'{incomplete}",
            "point resume at a run dir that saved a complete checkpoint (checkpoints/step*.ckpt)",
        )
    return point


def original_overrides(resume: str) -> list[str]:
    """Overrides recorded by Hydra when the run to resume was started ([] if it left no record)."""
    record = run_dir_of(Path(resume).expanduser()) / ".hydra" / "overrides.yaml"
    if not record.is_file():
        return []
    loaded = yaml.safe_load(record.read_text()) or []
    return [str(o) for o in loaded]
