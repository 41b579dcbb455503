"""Claiming a launch's run or sweep dir (job/claim.py): one exclusive create decides, a timestamped dir gets a
suffix, a named one is refused, and only a first launch's rank 0 claims."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from disttrain.config.errors import ConfigError
from disttrain.job import claim
from disttrain.job.claim import CLAIM_FILE, LaunchDir, as_override, claim_launch_dir, holder, try_claim
from disttrain.job.preflight import preflight
from tests.conftest import CONF, TINY_MODEL

RUN = ("run.json", ".hydra/overrides.yaml")


def run_dir(path: Path, timestamped: bool) -> LaunchDir:
    return LaunchDir("hydra.run.dir", path, timestamped)


def test_the_first_claim_wins_and_the_second_is_told_who_holds_the_dir(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    assert try_claim(target, RUN) is None  # parents created
    owner = json.loads((target / CLAIM_FILE).read_text())
    assert owner["pid"] == os.getpid() and owner["host"] and owner["time"] > 0
    taken = try_claim(target, RUN)
    assert taken is not None and f"claimed by pid {os.getpid()} on {owner['host']}" in taken
    assert json.loads((target / CLAIM_FILE).read_text()) == owner  # the loser wrote nothing


def test_a_claim_still_being_written_reads_as_another_launch(tmp_path: Path) -> None:
    (tmp_path / CLAIM_FILE).write_text("")  # created, its owner not written yet
    assert holder(tmp_path, RUN) == f"{CLAIM_FILE}: claimed by another launch"


def test_a_dir_an_earlier_run_wrote_before_claims_existed_is_taken_and_left_untouched(tmp_path: Path) -> None:
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("[]\n")
    assert try_claim(tmp_path, RUN) == ".hydra/overrides.yaml"
    assert not (tmp_path / CLAIM_FILE).exists()


# Each racer is its own interpreter (no fork of a threaded pytest worker, which can hang a child): it says it is
# ready, waits for the gate, then claims; the parent opens the gate only when every racer waits at it.
RACER = """
import json, os, sys, time
from pathlib import Path
from disttrain.job.claim import try_claim
gate, ready, target = map(Path, sys.argv[1:4])
(ready / str(os.getpid())).touch()
deadline = time.monotonic() + 120
while not gate.exists():
    if time.monotonic() > deadline:
        sys.exit("the gate never opened")
    time.sleep(0.0005)
print(json.dumps([os.getpid(), try_claim(target, ("run.json", ".hydra/overrides.yaml")) is None]))
"""


@pytest.mark.parametrize("attempt", range(3))
def test_of_processes_claiming_one_dir_at_once_exactly_one_gets_it(tmp_path: Path, attempt: int) -> None:
    gate, ready, target = tmp_path / "gate", tmp_path / "ready", tmp_path / "run"
    ready.mkdir()
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(gate), str(ready), str(target)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    deadline = time.monotonic() + 120
    while len(list(ready.iterdir())) < len(racers) and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.touch()
    outcomes = []
    for racer in racers:
        out, err = racer.communicate(timeout=150)
        assert racer.returncode == 0, err
        outcomes.append(json.loads(out))
    winners = [pid for pid, won in outcomes if won]
    assert len(winners) == 1
    assert json.loads((target / CLAIM_FILE).read_text())["pid"] == winners[0]


def test_a_taken_timestamped_dir_gets_the_next_free_suffix(tmp_path: Path) -> None:
    base = tmp_path / "outputs" / "2026-11-21" / "07-27-02"
    assert claim_launch_dir(run_dir(base, True)) == base
    assert claim_launch_dir(run_dir(base, True)) == base.with_name("07-27-02-1")
    (base.with_name("07-27-02-2") / "run.json").parent.mkdir()
    (base.with_name("07-27-02-2") / "run.json").write_text("{}")  # an earlier run's, unclaimed
    assert claim_launch_dir(run_dir(base, True)) == base.with_name("07-27-02-3")


def test_a_named_dir_another_launch_claimed_is_refused_in_one_line(tmp_path: Path) -> None:
    named = tmp_path / "mine"
    claim_launch_dir(run_dir(named, False))
    (named / "run.json").write_text('{"status": "running"}')
    with pytest.raises(ConfigError) as refused:
        claim_launch_dir(run_dir(named, False))
    err = refused.value
    assert err.key == "hydra.run.dir" and "already holds a run (.claim.json: claimed by pid" in err.problem
    assert "hydra.run.dir=<new dir>" in err.fix and "resume=<that dir>" in err.fix and "\n" not in str(err)
    assert (named / "run.json").read_text() == '{"status": "running"}'


def test_a_sweep_dir_is_claimed_as_a_sweep(tmp_path: Path) -> None:
    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")
    with pytest.raises(ConfigError) as refused:
        claim_launch_dir(LaunchDir("hydra.sweep.dir", tmp_path, False))
    assert refused.value.key == "hydra.sweep.dir" and "already holds a sweep (multirun.yaml)" in refused.value.problem
    assert "resume" not in refused.value.fix
    assert claim_launch_dir(LaunchDir("hydra.sweep.dir", tmp_path, True)) == tmp_path.with_name(f"{tmp_path.name}-1")


def test_a_dir_that_cannot_be_created_is_the_users_key_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot create") as refused:
        claim_launch_dir(run_dir(tmp_path / "file" / "run", False))
    assert refused.value.key == "hydra.run.dir"


def test_suffixes_run_out_with_an_error_not_a_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(claim, "MAX_SUFFIX", 2)
    for _ in range(3):
        claim_launch_dir(run_dir(tmp_path / "t", True))
    with pytest.raises(ConfigError, match="2 suffixed siblings are all taken"):
        claim_launch_dir(run_dir(tmp_path / "t", True))


@pytest.mark.parametrize(
    "path", ["outputs/2026-11-21/07-27-02-1", "/runs/a b", "/runs/it's", "/runs/x,y", "/runs/back\\slash", "/r\\", "12"]
)
def test_the_claimed_dir_reaches_hydra_as_exactly_that_path(path: str) -> None:
    (parsed,) = OverridesParser.create().parse_overrides([as_override("hydra.run.dir", Path(path))])
    assert parsed.key_or_group == "hydra.run.dir" and parsed.value() == path


@pytest.fixture
def user_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment of a process the user started (no launcher variables from the test runner)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_PROCID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)


def test_the_default_run_dir_is_timestamped_a_named_one_is_not_and_a_sweep_claims_its_sweep_dir(
    user_started: None, tmp_path: Path
) -> None:
    default = preflight([*TINY_MODEL, "dry_run=true"], CONF).launch_dir
    assert default is not None and default.key == "hydra.run.dir" and default.timestamped
    assert default.path.parts[0] == "outputs"
    named = preflight([*TINY_MODEL, "dry_run=true", f"hydra.run.dir={tmp_path / 'r'}"], CONF).launch_dir
    assert named == LaunchDir("hydra.run.dir", tmp_path / "r", False)
    sweep = preflight(["-m", *TINY_MODEL, "optimizer.lr=1e-3,3e-3"], CONF).launch_dir
    assert sweep is not None and sweep.key == "hydra.sweep.dir" and sweep.timestamped
    assert not any(tmp_path.iterdir()) and not default.path.exists()  # checking creates nothing: the claim does


@pytest.mark.parametrize(
    "env",
    [
        {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2"},  # a torchrun worker other than rank 0
        {"SLURM_NTASKS": "2", "SLURM_PROCID": "1"},  # an srun task other than rank 0
        {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "1"},  # a restart
    ],
)
def test_only_a_first_launchs_rank_zero_claims_the_others_join(
    user_started: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # Rank 0 claimed and started writing: the others join its dir rather than being refused.
    claim_launch_dir(run_dir(tmp_path / "r", False))
    (tmp_path / "r" / "run.json").write_text('{"status": "running"}')
    checked = preflight([*TINY_MODEL, f"hydra.run.dir={tmp_path / 'r'}"], CONF)
    assert checked.launch_dir is None
