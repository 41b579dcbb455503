"""What run.json records about the code and the machine (its schema: ``diagnostics.manifest.RunManifest``)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def command_line() -> list[str]:
    return [sys.executable, *sys.argv]
