"""hydra/sweeper=optuna: what a job returns, the direction that follows ``objective=``, the command's checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from disttrain.config.errors import ConfigError
from disttrain.job.preflight import preflight
from disttrain.sweep.objective import objective_direction, objective_value
from tests.conftest import CONF


def write_result(run_dir: Path, **result: float | None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps({"status": "completed", "result": result}))
    return run_dir


def test_the_job_returns_its_final_val_loss_or_tokens_per_s_from_run_json(tmp_path: Path) -> None:
    run_dir = write_result(tmp_path / "run", val_loss=2.75, tokens_per_s=12345.5, train_loss=2.7)
    assert objective_value(run_dir, "val_loss") == 2.75
    assert objective_value(run_dir, "tokens_per_s") == 12345.5
    assert objective_value(write_result(tmp_path / "no-val", val_loss=None), "val_loss") is None
    assert objective_value(tmp_path / "never-ran", "val_loss") is None  # a rank that writes no run.json


def test_direction_follows_the_objective() -> None:
    assert objective_direction("val_loss") == "minimize"
    assert objective_direction("tokens_per_s") == "maximize"
    assert objective_direction("samples_per_s") == "maximize"
    with pytest.raises(ValueError, match="objective"):
        objective_direction("val acc")


@pytest.mark.parametrize(
    ("objective", "direction"),
    [
        ("val_acc", "maximize"), ("val/accuracy", "maximize"), ("top5_acc", "maximize"), ("val_auc", "maximize"),
        ("f1", "maximize"), ("map50", "maximize"), ("val_mse", "minimize"), ("val_mae", "minimize"),
        ("loss", "minimize"), ("max:val_score", "maximize"), ("min:val_acc", "minimize"), ("images_per_s", "maximize"),
    ],
)  # fmt: skip
def test_a_metric_a_module_logs_is_maximized_where_its_name_measures_a_gain(objective: str, direction: str) -> None:
    assert objective_direction(objective) == direction


def test_a_lightning_modules_objective_is_read_from_its_final_logged_metrics(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = {"val_loss": None, "samples_per_s": 900.0, "metrics": {"val_acc": 0.93, "val_loss": 0.2}}
    (run_dir / "run.json").write_text(json.dumps({"status": "completed", "result": result}))
    assert objective_value(run_dir, "val_acc") == 0.93
    assert objective_value(run_dir, "max:val_acc") == 0.93
    assert objective_value(run_dir, "val_loss") == 0.2  # the module's own val_loss, where the built-in one is absent
    assert objective_value(run_dir, "samples_per_s") == 900.0
    assert objective_value(run_dir, "val_f1") is None  # not logged: the trial fails, as a run without validation


@pytest.mark.parametrize(("objective", "direction"), [(None, "minimize"), ("tokens_per_s", "maximize")])
def test_the_optuna_sweeper_config_takes_its_direction_from_objective(objective: str | None, direction: str) -> None:
    overrides = ["hydra/sweeper=optuna", *([f"objective={objective}"] if objective else [])]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides, return_hydra_config=True)
    sweeper = OmegaConf.to_container(cfg.hydra.sweeper, resolve=True)
    assert sweeper["_target_"] == "hydra_plugins.disttrain_sweeper.optuna_sweeper.OptunaSweeper"
    assert sweeper["direction"] == direction
    assert sweeper["sampler"]["name"] == "tpe" and sweeper["pruner"]["name"] == "none"


def test_a_sampled_interval_is_checked_before_launch() -> None:
    # Optuna's interval syntax passes the checks (its start stands for the sampled values) ...
    preflight(["-m", "hydra/sweeper=optuna", "optimizer.lr=tag(log,interval(1e-4,1e-2))"], CONF)
    preflight(["-m", "hydra/sweeper=optuna", "model.n_layers=int(interval(1,4))"], CONF)
    # ... and a wrong key or a bad objective is one line before anything runs.
    with pytest.raises(ConfigError, match=r"optimizer\.lrr"):
        preflight(["-m", "hydra/sweeper=optuna", "optimizer.lrr=tag(log,interval(1e-4,1e-2))"], CONF)
    with pytest.raises(ConfigError, match="objective") as err:
        preflight(["-m", "hydra/sweeper=optuna", "objective=loss"], CONF)
    assert "tokens_per_s" in str(err.value)
