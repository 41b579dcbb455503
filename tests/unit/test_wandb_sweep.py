"""A sweep's jobs share one wandb group, and the sweep report lands in that group (an offline wandb run)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from disttrain.training.wandb_sweep import attach_sweep_report, run_group, sweep_group, sweep_logger


def job(sweep_dir: Path, num: int, mode: str = "MULTIRUN", logger: str = "wandb") -> Path:
    """A job directory as Hydra leaves it: .hydra/hydra.yaml (mode, sweep dir) and .hydra/config.yaml."""
    run_dir = sweep_dir / str(num)
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save({"hydra": {"mode": mode, "sweep": {"dir": str(sweep_dir)}}}, run_dir / ".hydra" / "hydra.yaml")
    config = {"logger": {"name": logger, "project": "disttrain-test", "mode": "offline", "entity": None}}
    OmegaConf.save(config, run_dir / ".hydra" / "config.yaml")
    return run_dir


def test_every_job_of_a_sweep_names_the_same_group_and_a_single_run_none(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "multirun" / "2026-11-27" / "08-45-00"
    assert run_group(job(sweep_dir, 0)) == run_group(job(sweep_dir, 1)) == "2026-11-27_08-45-00"
    assert sweep_group(sweep_dir) == "2026-11-27_08-45-00"
    assert run_group(job(tmp_path / "single", 0, mode="RUN")) is None
    assert run_group(tmp_path / "no-hydra-files") is None


def test_the_sweep_report_goes_to_wandb_only_where_the_jobs_logged_there(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    from tests.logged import _wandb_records

    monkeypatch.setenv("WANDB_SILENT", "true")
    csv_sweep = tmp_path / "csv"
    job(csv_sweep, 0, logger="csv")
    assert attach_sweep_report(csv_sweep, csv_sweep, "summary") is None
    sweep_dir = tmp_path / "multirun" / "2026-11-27" / "09-00-00"
    job(sweep_dir, 0)
    assert sweep_logger(sweep_dir)["project"] == "disttrain-test"
    report = sweep_dir / "report"
    report.mkdir()
    (report / "sweep.md").write_text("# sweep\n")
    where = attach_sweep_report(sweep_dir, report, "best final loss 4.9: 0")
    assert where is not None
    (offline,) = (sweep_dir / "wandb").glob("offline-run-*")
    # wandb's service process writes the run's records; under a loaded suite they reached the file after finish()
    # returned (one CI run read it empty): wait for them rather than read a file still being written.
    deadline = time.monotonic() + 30
    while True:
        data = b"".join(raw for path in offline.glob("*.wandb") for raw in _wandb_records(path))
        if b"sweep-report" in data or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert b"sweep-report" in data and b"2026-11-27_09-00-00" in data  # the artifact, in the sweep's group


def test_a_sweep_jobs_wandb_logger_joins_its_sweeps_group(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    from disttrain.config.schema import LoggerConfig
    from disttrain.training.build import build_loggers

    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = job(tmp_path / "multirun" / "2026-11-27" / "10-00-00", 3)
    (logger,) = build_loggers(LoggerConfig(name="wandb"), run_dir, run_dir.name)
    assert logger._wandb_init["group"] == "2026-11-27_10-00-00"  # set before wandb.init: nothing started yet
