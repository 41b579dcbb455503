"""``resume=<run_dir>``: find the checkpoint to continue from and the overrides the run was started with."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from disttrain.config.errors import ConfigError

STEP_CHECKPOINT = re.compile(r"^step(\d+)\.ckpt$")


def run_dir_of(path: Path) -> Path:
    """The run directory a resume path points into (the path itself, or the parent of checkpoints/)."""
    if path.name == "checkpoints" or path.parent.name == "checkpoints":
        return path.parent if path.name == "checkpoints" else path.parent.parent
    return path


def find_checkpoint(resume: str) -> Path:
    """``resume`` may be a run dir, its ``checkpoints/`` dir, or one checkpoint (file, or DCP directory)."""
    path = Path(resume).expanduser()
    if not path.exists():
        raise ConfigError("resume", f"'{resume}' does not exist", "point resume at a run dir under outputs/")
    if path.name.endswith(".ckpt"):
        return path.resolve()
    ckpt_dir = path if path.name == "checkpoints" else path / "checkpoints"
    last = ckpt_dir / "last.ckpt"
    if last.exists():
        return last.resolve()
    steps = sorted((int(m.group(1)), p) for p in ckpt_dir.glob("step*.ckpt") if (m := STEP_CHECKPOINT.match(p.name)))
    if not steps:
        raise ConfigError(
            "resume",
            f"no checkpoint found in '{ckpt_dir}'",
            "point resume at a run dir that saved checkpoints (checkpoints/last.ckpt or step*.ckpt)",
        )
    return steps[-1][1].resolve()


def original_overrides(resume: str) -> list[str]:
    """Overrides recorded by Hydra when the run to resume was started ([] if it left no record)."""
    record = run_dir_of(Path(resume).expanduser()) / ".hydra" / "overrides.yaml"
    if not record.is_file():
        return []
    loaded = yaml.safe_load(record.read_text()) or []
    return [str(o) for o in loaded]
