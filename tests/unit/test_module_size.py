"""No module of the product over 500 lines: a module that grows past it holds more than one job (split it by what
each part does, as diagnostics/kinds/ and strategies/<name>_spec.py are split)."""

from __future__ import annotations

from tests.conftest import REPO

MAX_LINES = 500


def test_no_module_over_the_limit() -> None:
    sizes = {
        path.relative_to(REPO).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for root in ("src/disttrain", "diagnostics", "pipelines")
        for path in (REPO / root).rglob("*.py")
    }
    assert len(sizes) > 100
    over = {name: lines for name, lines in sizes.items() if lines > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"
