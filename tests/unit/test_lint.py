"""The house style is enforced, not hoped for: ruff's lint rules and its formatter pass over the whole repository.

Both run the ruff the dev extras pin (pyproject.toml), with the settings in ``[tool.ruff]``; a failure prints
ruff's own findings, so the fix is ``ruff check --fix .`` / ``ruff format .`` on what it names.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["ruff-check", "ruff-format"])
def test_ruff_passes_over_the_repository(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"ruff {' '.join(command)} failed:\n{result.stdout[-6000:]}{result.stderr[-2000:]}"
