"""report.html opens in a real headless browser (Debian's chromium): plots drawn, no console errors, a screenshot.

Chromium is a test dependency (CI installs it): without it this test fails and says how to install it.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from diagnostics.report import diagnose_run
from tests.diag_fixtures import write_run

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
INSTALL = "apt-get update && apt-get install -y chromium"
PLOTS = {"step-phases", "comm-compute", "utilization", "memory", "step-time"}
# Chromium prints page console messages (errors, uncaught exceptions) as ":CONSOLE" log lines on stderr.
CONSOLE = re.compile(r":CONSOLE|Uncaught", re.I)


def render(page: Path, screenshot: Path, profile: Path) -> tuple[str, str]:
    """(DOM after load, browser stderr) of ``page``, writing a 1280x2000 screenshot."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"chromium is not installed ({CHROMIUM} missing): install it with `{INSTALL}`")
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
        "--enable-logging=stderr", "--v=0", f"--screenshot={screenshot}", "--window-size=1280,2000", "--dump-dom",
        page.resolve().as_uri(),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, result.stderr


class PlotParser(HTMLParser):
    """Per ``svg.plot``: how many drawn marks (bars with height, polylines with points) it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.marks: dict[str, int] = {}
        self.current: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "svg" and a.get("class") == "plot":
            self.current = a.get("data-plot")
            self.marks[self.current or ""] = 0
        elif self.current and self.drawn(tag, a):
            self.marks[self.current] += 1

    @staticmethod
    def drawn(tag: str, a: dict[str, str | None]) -> bool:
        if tag == "rect" and a.get("class") == "bar":
            return float(a.get("height") or 0) > 0
        return tag == "polyline" and len((a.get("points") or "").split()) > 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self.current = None


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", header[16:24])


def test_report_html_renders_in_chromium(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", "comm_bound")
    report_dir = diagnose_run(run_dir).written_to
    shot = tmp_path / "report.png"
    dom, stderr = render(report_dir / "report.html", shot, tmp_path / "profile")
    shutil.copy(shot, report_dir / "report.png")  # kept next to the report it shows

    errors = [line for line in stderr.splitlines() if CONSOLE.search(line)]
    assert errors == [], errors
    parser = PlotParser()
    parser.feed(dom)
    assert set(parser.marks) == PLOTS
    assert all(count > 0 for count in parser.marks.values()), parser.marks
    assert 'data-kind="comm_bound"' in dom and "trainer.global_batch_size=64" in dom
    assert png_size(shot) == (1280, 2000)
    assert shot.stat().st_size > 50_000, "screenshot looks blank"


def test_console_errors_would_be_caught(tmp_path: Path) -> None:
    """Control: the same check flags a page that throws (so a clean report is really clean)."""
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><body><p>x</p><script>missing_function();</script></body></html>")
    _, stderr = render(page, tmp_path / "broken.png", tmp_path / "profile")
    assert any(CONSOLE.search(line) for line in stderr.splitlines())
