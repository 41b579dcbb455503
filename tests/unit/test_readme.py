"""The README's two commands are the ones that work: CI runs the test command verbatim."""

from __future__ import annotations

import re

from tests.conftest import REPO


def readme_commands() -> list[str]:
    block = re.search(r"## Two commands.*?```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert block, "README lost its 'Two commands' block"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_readme_gives_exactly_two_commands_and_ci_runs_the_test_one() -> None:
    train, test = readme_commands()
    assert train.endswith("-m train") and test.endswith("-m pytest")
    ci_lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if "-m pytest" in line]
    assert ci_lines == [test]
