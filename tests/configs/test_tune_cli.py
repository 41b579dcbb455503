"""``python -m tune`` as a user runs it: settings composed from conf/tune.yaml, bad input refused before any run,
and the loop driven end to end over a fake ``python -m train`` that writes recorded telemetry (tests.diag_fixtures):
deterministic verdicts, so the keep and stop rules are checked on the whole command, not only as functions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tune import main, split_argv, tune_settings

from diagnostics.ab import ledger
from disttrain.config.errors import ConfigError
from disttrain.tune.arms import Placement, placement
from disttrain.tune.experiment import experiment_yaml
from disttrain.tune.settings import TuneSettings
from tests.conftest import CONF, REPO

# Writes the fixture run of a scenario (by the overrides it was given) and a loss curve, as a finished train would.
FAKE_TRAIN = """
import json, os, sys
from pathlib import Path
from tests.diag_fixtures import write_run
args = sys.argv[1:]
run_dir = Path(next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")))
with open(__file__ + ".calls", "a") as calls:
    calls.write(json.dumps(args) + "\\n")
scenario, loss = os.environ["FAKE_START"], 1.0
for override, (name, shift) in json.loads(os.environ["FAKE_RULES"]).items():
    if override in args:
        scenario, loss = name, 1.0 + shift
write_run(run_dir, scenario)
(run_dir / "metrics").mkdir()
(run_dir / "metrics" / "metrics.csv").write_text("step,train/loss\\n9,%r\\n19,%r\\n" % (2 * loss, loss))
"""


def tune(args: list[str], tmp_path: Path, start: str, rules: dict) -> tuple[subprocess.CompletedProcess, Path]:
    fake = tmp_path / "fake"
    fake.mkdir(exist_ok=True)
    (fake / "train.py").write_text(FAKE_TRAIN)
    env = {
        **os.environ,
        "PYTHONPATH": f"{fake}{os.pathsep}{REPO}",
        "FAKE_START": start,
        "FAKE_RULES": json.dumps(rules),
    }
    env.pop("LOCAL_RANK", None)
    out = tmp_path / "runs" / "tune"
    command = [sys.executable, "-m", "tune", f"tune.output_dir={out}", *args]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return result, out


def test_default_settings_compose_from_conf_tune_yaml() -> None:
    settings = tune_settings([])
    assert settings == TuneSettings(60.0, 30, 4, (), 3, 6, 0.02, 0.05, None)
    opened = tune_settings(["tune.allow=[global_batch,precision]", "tune.budget_min=15", "tune.max_rounds=2"])
    assert (opened.allow, opened.budget_s, opened.max_rounds) == (("global_batch", "precision"), 900.0, 2)
    assert split_argv(["strategy=fsdp", "tune.steps=20", "+data.num_workers=2"]) == (
        ["tune.steps=20"],
        ["strategy=fsdp", "+data.num_workers=2"],
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tune.stepz=20"], "tune.stepz: is not a tune setting (did you mean 'steps'?)"),
        (["tune.steps=3"], "tune.steps: 3 steps leave too few steady steps to diagnose. Fix: set tune.steps=10"),
        (["tune.allow=[global_bach]"], "unknown lever class 'global_bach' (did you mean 'global_batch'?)"),
        (["tune.repeats=4", "tune.max_repeats=3"], "tune.max_repeats: 3 is below tune.repeats=4"),
        (["tune.loss_tolerance=0"], "tune.loss_tolerance: must lie in (0, 1)"),
        (["trainer.max_steps=50"], "trainer.max_steps: is set by tune for every run. Fix: set tune.steps instead"),
        (["hydra.run.dir=x"], "hydra.run.dir: is set by tune for every run. Fix: set tune.output_dir instead"),
        (["hydra/launcher=slurmm"], "hydra/launcher: unknown launcher 'slurmm' (did you mean 'slurm'?)"),
        (["hydra.launcher.partition=debug"], "hydra.launcher.partition: sets a launcher, but no launcher is chosen"),
        (["--cfg", "job"], "--cfg: is not an option of tune"),
        (
            ["strategy.bucket_cap=5"],
            "strategy.bucket_cap: is not a setting of strategy (did you mean 'bucket_cap_mb'?)",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    out = tmp_path / "tune"
    assert main([f"tune.output_dir={out}", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_help_lists_every_setting_with_its_default_and_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tune"
    assert main([f"tune.output_dir={out}", "strategy=fsdp", "--help"]) == 0
    text = capsys.readouterr().out
    defaults = OmegaConf.to_container(OmegaConf.load(CONF / "tune.yaml").tune)
    for key, value in defaults.items():
        shown = "[]" if value == [] else "null" if value is None else str(value)
        assert f"  tune.{key}={shown} " in text
    assert "global_batch, precision, lossy_comm" in text  # tune.allow's classes, from the comment above it
    assert not out.exists()


def test_the_final_config_as_an_experiment_composes_like_its_overrides(tmp_path: Path) -> None:
    overrides = ["strategy=fsdp", "trainer.micro_batch_size=8", "trainer.global_batch_size=32", "model.compile=true"]
    groups = {p.name for p in CONF.iterdir() if p.is_dir()} - {"hydra"}
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "tuned.yaml").write_text(experiment_yaml(overrides, groups, "tuned") or "")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        direct = OmegaConf.to_container(compose("train", overrides=overrides))
        via = compose("train", overrides=["experiment=tuned", f"hydra.searchpath=[file://{tmp_path}]"])
    assert OmegaConf.to_container(via) == direct
    assert experiment_yaml(["~data", "+data._target_=x.Y"], groups, "") is None  # a deletion has no experiment form


def test_tune_keeps_a_confirmed_lever_then_stops_when_nothing_costs_5_percent(tmp_path: Path) -> None:
    result, out = tune(["tune.max_rounds=2"], tmp_path, "input_bound", {"data.num_workers=2": ("healthy", 0.0)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "tune" / "summary.json").read_text())
    (row,) = summary["rounds"]
    assert (row["finding"], row["override"], row["lever"], row["verdict"], row["kept"]) == (
        "input_bound",
        "data.num_workers=2",
        "loader",
        "confirmed",
        True,
    )
    assert row["loss_gap"] == 0.0 and row["cumulative"] == pytest.approx(1 + row["change"]) and row["change"] > 0.5
    assert summary["stop_reason"] == "no finding costs 5% of the step or more"
    assert summary["final_overrides"] == ["data.num_workers=2"] and summary["kept"] == ["data.num_workers=2"]
    # Every run is the user's command plus tune's length and no checkpoints; the final config drops them.
    calls = [json.loads(line) for line in (tmp_path / "fake" / "train.py.calls").read_text().splitlines()]
    assert calls[0][:2] == ["trainer.max_steps=30", "trainer.ckpt_every_n_steps=0"]
    assert len(calls) == 1 + 2 * 3  # the start, then 3 interleaved rounds of both arms; round 2 reuses a B run
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("round  finding"))
    row_line = next(line for line in lines[header:] if line.startswith("1 "))
    assert "data.num_workers=2" in row_line and "confirmed" in row_line and "yes" in row_line
    assert "tune: reproduce: python -m train data.num_workers=2" in result.stdout
    assert (out / "tune" / "tuned.yaml").read_text().endswith("data:\n  num_workers: 2\n")
    assert "| 1 | input_bound | data.num_workers=2 |" in (out / "tune" / "summary.md").read_text()
    (entry,) = ledger.read(tmp_path / "runs" / ledger.LEDGER)
    assert (entry["source"], entry["finding"], entry["verdict"], entry["kept"]) == (
        "tune",
        "input_bound",
        "confirmed",
        True,
    )
    assert entry["measured_change"] == row["change"] and entry["context"]["strategy"] == "ddp"


def test_a_faster_lever_whose_losses_drift_is_not_kept(tmp_path: Path) -> None:
    result, out = tune([], tmp_path, "input_bound", {"data.num_workers=2": ("healthy", 0.05)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "tune" / "summary.json").read_text())
    (row,) = summary["rounds"]
    assert row["verdict"] == "confirmed" and not row["kept"] and row["loss_gap"] == pytest.approx(0.05)
    assert "losses differ by 5.00% (> tolerance 2.00%)" in row["reason"]
    assert summary["final_overrides"] == [] and summary["speedup"] == 1.0
    assert summary["stop_reason"] == "no config lever left for the costly findings"


def test_a_straggler_changes_nothing_and_names_the_rank_and_the_cause(tmp_path: Path) -> None:
    result, out = tune([], tmp_path, "straggler", {})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "tune" / "summary.json").read_text())
    assert summary["rounds"] == [] and summary["final_overrides"] == []
    (note,) = summary["no_lever"]
    assert note["finding"] == "straggler" and note["ranks"] == [2] and "rank 2" in note["why"]
    assert "tune: no config lever: straggler on rank(s) [2]: No config lever: rank 2" in result.stdout
    assert "tune: no change kept: the starting config stays" in result.stdout


def test_arms_on_slurm_are_one_job_multiruns_whose_job_lands_in_the_run_dir_the_ab_chose(tmp_path: Path) -> None:
    launchers = [p.stem for p in (CONF / "hydra" / "launcher").glob("*.yaml")]
    assert placement([], launchers) == Placement()  # no launcher: the runs go here
    slurm = placement(["hydra/launcher=slurm", "hydra.launcher.partition=debug"], launchers, has_sbatch=True)
    assert slurm == Placement("slurm", ("hydra.launcher.partition=debug",))
    with pytest.raises(ConfigError, match=r"hydra/launcher: slurm: no sbatch on PATH .* leave hydra/launcher out"):
        placement(["hydra/launcher=slurm"], launchers, has_sbatch=False)
    run_dir = tmp_path / "round1" / "01-A"
    argv = slurm.argv(["trainer.max_steps=20"], run_dir)
    assert argv == [
        "-m",
        "hydra/launcher=slurm",
        "hydra.launcher.partition=debug",
        "trainer.max_steps=20",
        f"hydra.sweep.dir={run_dir}.slurm",
        f"hydra.sweep.subdir={run_dir}",
    ]
    assert Placement().argv(["trainer.max_steps=20"], run_dir) == ["trainer.max_steps=20", f"hydra.run.dir={run_dir}"]
    # The job's dir (Hydra joins sweep.dir and subdir) is the run dir itself; the sweep's files go beside it.
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=argv[1:], return_hydra_config=True)
    assert cfg.hydra.launcher.partition == "debug" and cfg.hydra.launcher.tasks_per_node == 2
    assert Path(os.path.join(cfg.hydra.sweep.dir, cfg.hydra.sweep.subdir)) == run_dir
