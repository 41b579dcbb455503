"""hydra/sweeper=optuna without processes: the search space, typed values, the sweeper's checks, screening."""

from __future__ import annotations

import socket
from pathlib import Path

import optuna
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from disttrain.config.errors import ConfigError
from disttrain.job.claim import CLAIM_FILE, LaunchDir, claim_launch_dir
from disttrain.job.preflight import preflight
from disttrain.job.screen import job_config, screen
from disttrain.sweep.space import build_search_space, format_value
from disttrain.sweep.study import STUDY_RECORD, open_study, sweep_settings
from disttrain.sweep.trials import counted, screen_out
from tests.conftest import CONF


def space(*overrides: str, params: dict | None = None):
    return build_search_space(OverridesParser.create().parse_overrides(list(overrides)), params)


def test_each_sweep_form_becomes_its_distribution() -> None:
    s = space(
        "a=choice(1,2,x)",
        "b=3,4",
        "c=range(2,9,3)",
        "d=interval(0.1,0.5)",
        "e=int(interval(1,4))",
        "f=tag(log,interval(1e-4,1e-2))",
        "g=range(0.5,2.0,0.5)",
    )
    d = s.distributions
    assert d["a"] == CategoricalDistribution([1, 2, "x"])
    assert d["b"] == CategoricalDistribution([3, 4])
    assert d["c"] == IntDistribution(2, 8, step=3)  # range's stop is exclusive: 2, 5, 8
    assert d["d"] == FloatDistribution(0.1, 0.5)
    assert d["e"] == IntDistribution(1, 4)
    assert d["f"] == FloatDistribution(1e-4, 1e-2, log=True)
    assert d["g"] == CategoricalDistribution([0.5, 1.0, 1.5])  # floats: a choice of the values


def test_fixed_params_keep_their_types_and_null_stays_null() -> None:
    s = space("trainer.max_steps=7", params={"model.dropout": None, "x.flag": True, "x.n": 3, "x.lr": "choice(1,2)"})
    assert s.fixed == {"model.dropout": None, "x.flag": True, "x.n": 3}
    overrides = s.job_overrides({"x.lr": 2})
    assert overrides == ["trainer.max_steps=7", "model.dropout=null", "x.flag=true", "x.n=3", "x.lr=2"]
    parsed = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(overrides)}
    assert parsed == {"trainer.max_steps": 7, "model.dropout": None, "x.flag": True, "x.n": 3, "x.lr": 2}


@pytest.mark.parametrize("value", [None, True, 3, 0.001, 1e-5, "fsdp", "1", "null", "a b", "it's", [1, "x"]])
def test_a_value_reads_back_as_itself(value: object) -> None:
    (override,) = OverridesParser.create().parse_overrides([f"k={format_value(value)}"])
    assert override.value() == value and type(override.value()) is type(value)


def test_the_command_line_wins_over_params_and_bad_spaces_name_the_key() -> None:
    assert space("a=choice(5,6)", params={"a": "choice(1,2)"}).distributions["a"].choices == (5, 6)
    with pytest.raises(ConfigError, match=r"^a: interval\(2.0, 1.0\) is empty"):
        space("a=interval(2,1)")
    with pytest.raises(ConfigError, match=r"^a: a log interval must start above 0"):
        space("a=tag(log,interval(0,1))")
    with pytest.raises(ConfigError, match=r"^d: is a continuous interval.*grid"):
        space("d=interval(0.1,0.5)").grid()
    assert space("a=1,2", "b=range(0,3)").grid_size() == 6


def node(**changes: object) -> dict:
    base = {"direction": "minimize", "n_trials": 4, "n_jobs": 2, "sampler": {"name": "tpe"}, "pruner": {"name": "none"}}
    return {**base, **changes}


def test_the_sweeper_settings_refuse_what_they_cannot_run() -> None:
    assert sweep_settings(node(pruner={"name": "median"}), "val_loss").prunes
    with pytest.raises(ConfigError, match=r"^hydra/sweeper/pruner: .*objective=tokens_per_s"):
        sweep_settings(node(pruner={"name": "median"}), "tokens_per_s")
    with pytest.raises(ConfigError, match=r"^hydra/sweeper/sampler: unknown sampler 'bayes'"):
        sweep_settings(node(sampler={"name": "bayes"}), "val_loss")
    with pytest.raises(ConfigError, match=r"^hydra.sweeper.storage"):
        sweep_settings(node(storage="study.db"), "val_loss")
    with pytest.raises(ConfigError, match=r"^hydra.sweeper.n_jobs"):
        sweep_settings(node(n_jobs=0), "val_loss")


def test_preflight_checks_the_sweep_before_anything_runs() -> None:
    with pytest.raises(ConfigError, match=r"^hydra/sweeper/pruner"):
        preflight(["-m", "hydra/sweeper=optuna", "hydra/sweeper/pruner=median", "objective=tokens_per_s"], CONF)
    with pytest.raises(ConfigError, match=r"^optimizer.lr: is a continuous interval"):
        preflight(["-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=grid", "optimizer.lr=interval(0.1,1)"], CONF)


def compose_job(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return job_config(compose(config_name="train", overrides=list(overrides), return_hydra_config=True))


def test_screening_refuses_a_micro_batch_the_profile_cannot_hold_and_passes_one_it_can() -> None:
    small = ["hw.memory_per_device_gib=1", "trainer.global_batch_size=4096", "trainer.micro_batch_size=2"]
    assert screen(compose_job(*small), small) is None
    big = [*small[:2], "trainer.micro_batch_size=2048"]
    reason = screen(compose_job(*big), big)
    assert reason is not None and reason.startswith("strategy: predicted") and "GiB usable" in reason
    assert screen(compose_job(*big, "check_memory=false"), [*big, "check_memory=false"]) is None
    bad = ["model.n_heads=5"]  # does not divide d_model: an invalid sampled combination is never launched either
    assert (screen(compose_job(*bad), bad) or "").startswith("model.n_heads")


def test_a_screened_trial_is_recorded_failed_with_its_reason_and_counts(tmp_path: Path) -> None:
    settings = sweep_settings(node(sampler={"name": "grid"}), "val_loss")
    study = open_study(settings, f"sqlite:///{tmp_path / 'optuna.db'}", {"a": [1, 2]})
    trial = study.ask({"a": CategoricalDistribution([1, 2])})
    screen_out(study, trial, "strategy: predicted 9 GiB")
    (frozen,) = study.get_trials()
    assert frozen.state == optuna.trial.TrialState.FAIL and frozen.user_attrs["disttrain.screened"].startswith("strat")
    assert counted(study) == 1


def test_a_study_sweep_dir_is_claimed_again_once_its_sweep_ended(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    launch = LaunchDir("hydra.sweep.dir", sweep, timestamped=False, continues_study=True)
    assert claim_launch_dir(launch) == sweep
    with pytest.raises(ConfigError, match="already holds a sweep"):  # no study yet: a plain taken dir
        claim_launch_dir(launch)
    (sweep / STUDY_RECORD).write_text("{}")
    with pytest.raises(ConfigError, match="still running"):  # this test's own process holds the claim
        claim_launch_dir(launch)
    (sweep / CLAIM_FILE).write_text(f'{{"pid": 999999999, "host": "{socket.gethostname()}", "time": 0}}')
    assert claim_launch_dir(launch) == sweep  # the claiming process is gone: the study continues here
