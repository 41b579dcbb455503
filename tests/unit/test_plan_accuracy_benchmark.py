"""benchmarks/plan_accuracy.py's host-share diagnostic: the parts probe's CPU share read back, and the error had the
run got that share."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.plan_accuracy import probe_share, share_adjusted
from diagnostics.telemetry import TelemetryWriter


def test_the_error_is_restated_at_the_probes_host_share(tmp_path: Path) -> None:
    for rank, share in enumerate((0.2, 0.3)):
        writer = TelemetryWriter(tmp_path, rank)
        writer.write("parts_calibration", cpu_share=share, block_forward_s=0.1)
        writer.close()
    assert probe_share(tmp_path) == pytest.approx(0.25)
    # Predicted at a probe share of 0.2 while the run got 0.4: 2x too slow, exactly the host's change.
    assert share_adjusted(1.0, 0.2, 0.4) == pytest.approx(0.0)
    assert share_adjusted(-0.2, 0.5, 0.5) == pytest.approx(-0.2)
    assert share_adjusted(0.1, None, 0.4) is None and probe_share(tmp_path / "missing") is None
