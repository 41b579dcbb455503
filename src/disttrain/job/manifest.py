"""``run.json``: what ran, where, on what, and what came out — enough to reproduce or compare runs."""

from __future__ import annotations

import dataclasses
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from diagnostics.files import write_text_atomic

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def versions() -> dict[str, str]:
    import hydra
    import lightning
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "hydra": hydra.__version__,
        "cuda": str(torch.version.cuda),
        "platform": platform.platform(),
    }


def git_commit(root: Path = PROJECT_ROOT) -> dict[str, Any] | None:
    """Commit of the code that ran (and whether it had local changes), or None outside a git checkout."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(dirty)}


def to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(to_jsonable(payload), indent=2, sort_keys=False) + "\n")


def command_line() -> list[str]:
    return [sys.executable, *sys.argv]
