"""The window and decile arithmetic of benchmarks/machine_noise.py over synthetic chunk timings (no runs)."""

from __future__ import annotations

import pytest

from benchmarks.machine_noise import chunks, deciles, window_medians


def test_window_medians_group_chunks_by_their_start_and_drop_windows_too_short_to_have_a_median() -> None:
    timed = [(0.1, 1.0, 0.9), (0.5, 1.2, 1.0), (0.9, 5.0, 1.1)]  # window 0: medians 1.2 (wall), 1.0 (CPU)
    timed += [(1.0, 2.0, 2.0), (1.4, 2.0, 2.2), (1.8, 2.0, 2.4)]  # window 1
    timed += [(2.0, 9.0, 9.0), (2.5, 9.0, 9.0)]  # window 2: two chunks, left out
    assert window_medians(timed, 1.0, column=1) == [1.2, 2.0]
    assert window_medians(timed, 1.0, column=2) == [1.0, 2.2]


def test_deciles_are_percentages_off_the_median() -> None:
    values = [float(v) for v in range(90, 111)]  # median 100
    low, high = deciles(values).split("/")
    assert float(low.rstrip("%")) == pytest.approx(-8.8, abs=0.05)
    assert float(high.rstrip("%")) == pytest.approx(8.8, abs=0.05)


def test_chunks_time_the_same_work_on_both_clocks() -> None:
    timed = chunks(seconds=0.2, size=32, per_chunk=5)
    assert len(timed) >= 2
    assert all(start >= 0 and wall > 0 and cpu > 0 for start, wall, cpu in timed)
    assert [row[0] for row in timed] == sorted(row[0] for row in timed)
