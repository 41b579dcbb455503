"""Every finding kind's report, rebuilt from a synthetic run dir, is byte-for-byte the kept one.

The run dirs are tests/diag_fixtures' scenarios (telemetry through the real writer, run.json composed from conf/),
one or more per finding kind; their report.json and report.md are kept in tests/golden/reports/. A refactor of the
analysis, the recommendations or the renderers that changes what a user reads fails here. A change meant to alter
a report regenerates the kept files (``DISTTRAIN_UPDATE_GOLDEN=1 pytest tests/unit/test_report_golden.py``), and
the diff of tests/golden/ in the commit shows what a user would now read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from diagnostics.report import build_report
from diagnostics.report.markdown import to_markdown
from tests.conftest import REPO
from tests.diag_fixtures import SCENARIOS, write_run

GOLDEN = REPO / "tests" / "golden" / "reports"
UPDATE = os.environ.get("DISTTRAIN_UPDATE_GOLDEN") == "1"
RUN_DIR = "<run>"  # where the run dir's path stood: tmp_path differs between sessions
CHECKOUT = "<repo>"  # where this checkout's path stood (a crash's traceback names the fixture's file)


def rendered(run_dir: Path) -> dict[str, str]:
    """report.json (less its time of writing) and report.md of ``run_dir``, the run dir's and the checkout's paths
    replaced."""
    report = build_report(run_dir)
    data = report.to_json()
    data.pop("generated_at")
    texts = {
        "json": json.dumps(data, indent=1, sort_keys=True, default=str) + "\n",
        "md": to_markdown(report, ""),
    }
    return {kind: text.replace(str(run_dir), RUN_DIR).replace(str(REPO), CHECKOUT) for kind, text in texts.items()}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_report_is_the_kept_one(tmp_path: Path, name: str) -> None:
    texts = rendered(write_run(tmp_path / name, name))
    for kind, text in texts.items():
        kept = GOLDEN / f"{name}.{kind}"
        if UPDATE:
            kept.write_text(text, encoding="utf-8")
            continue
        assert kept.is_file(), f"{kept} is missing: DISTTRAIN_UPDATE_GOLDEN=1 pytest {__file__} writes it"
        assert text == kept.read_text(encoding="utf-8"), f"{name}'s report.{kind} changed (see the module docstring)"


def test_every_kept_report_has_its_scenario() -> None:
    kept = {path.stem for path in GOLDEN.iterdir()}
    assert kept == set(SCENARIOS), "a kept report without a scenario (or the reverse): regenerate tests/golden/"
