"""The type checker runs in the suite: mypy over src/ and diagnostics/ at the level ``[tool.mypy]`` states
(pyproject.toml: mypy's defaults with strict Optional, the frameworks taken as Any), at zero errors, with no module
of ours excepted."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_mypy_finds_no_error_in_src_and_diagnostics() -> None:
    # No file arguments: the files and settings are pyproject.toml's, the same as a bare `mypy` in the checkout.
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"mypy found errors:\n{result.stdout[-8000:]}{result.stderr[-2000:]}"
    assert "Success: no issues found" in result.stdout


def test_no_module_of_ours_is_excepted_from_the_type_check() -> None:
    # Read as text: tomllib is Python 3.11+, and the project supports 3.10.
    mypy_section = (REPO / "pyproject.toml").read_text().split("[tool.mypy]", 1)[1].split("\n[tool.", 1)[0]
    assert "ignore_errors" not in mypy_section, "a module's errors are ignored: fix them instead"
