"""The steady-interval accounting of benchmarks/thread_cpu.py over synthetic /proc samples (no runs)."""

from __future__ import annotations

import os

import pytest

from benchmarks.thread_cpu import BLOCKED, QUEUED, SWITCHES, TRAIN, Sample, steady_cores

OWN = os.getpid()


def sample(
    at_s: float, rank_main: tuple[float, float], gloo: float, launcher: float, own: float, extra: float
) -> Sample:
    threads = {
        (101, 101): ("python", rank_main[0]),
        (102, 102): ("python", rank_main[1]),
        (101, 111): ("gloo_tcp_loop", gloo),
        (102, 112): ("gloo_tcp_loop", gloo),
        (200, 200): ("python", launcher),
        (OWN, OWN): ("python", own),
    }
    run_total = sum(cpu for _, cpu in threads.values())
    return Sample(at_s, threads, machine_busy_s=run_total + extra, steal_s=extra / 5)


def test_only_intervals_with_every_rank_training_count_and_each_group_gets_its_cores() -> None:
    samples = [
        sample(0.0, (0.0, 0.0), 0.0, 0.0, 0.0, 0.0),
        sample(0.5, (0.4, 0.0), 0.0, 0.3, 0.0, 0.05),  # start-up: rank 1 not training yet, left out
        sample(1.0, (0.85, 0.45), 0.01, 0.305, 0.001, 0.10),
        sample(1.5, (1.30, 0.90), 0.02, 0.310, 0.002, 0.15),
    ]
    cores = steady_cores(samples, world=2)
    assert cores["training threads (all ranks)"] == pytest.approx(1.8)
    assert cores["rank threads: gloo_tcp_loop"] == pytest.approx(0.04)
    assert cores["the run's other processes"] == pytest.approx(0.01)
    assert cores["this benchmark (sampler)"] == pytest.approx(0.002)
    assert cores["rest of the machine"] == pytest.approx(0.1)
    assert cores["steal (other guests)"] == pytest.approx(0.02)


def test_a_thread_born_inside_an_interval_is_not_charged_its_cpu_before_it() -> None:
    first = sample(0.0, (0.0, 0.0), 0.0, 0.0, 0.0, 0.0)
    second = sample(0.5, (0.45, 0.45), 0.01, 0.0, 0.0, 0.0)
    second.threads[102, 140] = ("pt_autograd_0", 3.0)  # new since the first sample: no baseline to subtract
    assert "rank threads: pt_autograd_0" not in steady_cores([first, second], world=2)


def test_busy_ranks_that_do_not_communicate_are_start_up_not_training() -> None:
    importing = [sample(0.0, (0.0, 0.0), 0.0, 0.0, 0.0, 0.0), sample(0.5, (0.45, 0.45), 0.0, 0.0, 0.0, 0.0)]
    assert steady_cores(importing, world=2) == {}
    assert steady_cores(importing[:1], world=2) == {}


def test_a_main_threads_wall_time_splits_into_running_queued_and_blocked() -> None:
    first = sample(0.0, (0.0, 0.0), 0.0, 0.0, 0.0, 0.0)
    second = sample(1.0, (0.9, 0.8), 0.02, 0.0, 0.0, 0.0)
    # schedstat's own clock (ns): rank 101 ran 0.9 s and queued 0.05, rank 102 ran 0.8 s and queued 0.02 of the
    # second; 12 and 30 blocking waits. The rest of each second (0.05, 0.18) the thread was blocked.
    first.waits = {(101, 101): (0.0, 0.0, 100), (102, 102): (0.0, 0.0, 200)}
    second.waits = {(101, 101): (0.9, 0.05, 112), (102, 102): (0.8, 0.02, 230)}
    cores = steady_cores([first, second], world=2)
    assert cores[QUEUED] == pytest.approx(0.07)
    assert cores[BLOCKED] == pytest.approx(0.23)
    assert cores[SWITCHES] == pytest.approx(42)
    assert cores[TRAIN] == pytest.approx(1.7)


def test_a_rank_without_schedstats_adds_no_wait_figures() -> None:
    samples = [sample(0.0, (0.0, 0.0), 0.0, 0.0, 0.0, 0.0), sample(1.0, (0.9, 0.8), 0.02, 0.0, 0.0, 0.0)]
    assert not {QUEUED, BLOCKED, SWITCHES} & set(steady_cores(samples, world=2))
