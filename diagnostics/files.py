"""Files a reader may open at any moment (run.json, the report, Hydra's record): written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary name beside ``path`` and rename: a reader (or a crash) never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
