"""Local ranks forked after rank 0's imports (launch/fork.py): the child is the module run as ``python -m`` would run
it, its exit reads as Popen's, and nothing forks where a lost thread could hang the child."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from disttrain.job import launcher as launcher_module
from disttrain.job.launcher import Launcher, LaunchKind
from disttrain.job.preflight import preflight
from disttrain.launch import fork
from disttrain.launch.fork import ForkedProcess, fork_module, pools_untouched
from tests.conftest import CONF, TINY_MODEL

# A module that records how it was run, then exits with the code it was given.
RECORDER = """
import json, os, sys
from pathlib import Path
Path(sys.argv[1]).write_text(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("FORK_TEST"),
                                          "name": __name__, "reset": os.environ.get("RESET_RAN")}))
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture
def recorder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "fork_recorder.py").write_text(RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    # Under xdist the worker has execnet's threads: this test's child runs no thread-pool code, so fork anyway.
    monkeypatch.setattr(fork.threading, "active_count", lambda: 1)
    return "fork_recorder"


def test_the_child_runs_the_module_as_main_with_its_arguments_environment_and_directory(
    tmp_path: Path, recorder: str
) -> None:
    out, cwd = tmp_path / "out.json", tmp_path / "elsewhere"
    cwd.mkdir()
    env = {**os.environ, "FORK_TEST": "yes"}
    child = fork_module(
        [sys.executable, "-m", recorder, str(out), "3"], env, str(cwd), lambda: os.environ.update(RESET_RAN="1")
    )
    assert isinstance(child, ForkedProcess)
    assert child.wait(timeout=60) == 3 and child.returncode == 3
    seen = json.loads(out.read_text())
    assert seen["name"] == "__main__" and seen["argv"][1:] == [str(out), "3"]
    assert seen["argv"][0].endswith("fork_recorder.py")  # as python -m puts the module's path there
    assert (seen["cwd"], seen["env"], seen["reset"]) == (str(cwd), "yes", "1")
    assert "FORK_TEST" not in os.environ and Path.cwd() != cwd  # this process is as it was


def test_a_killed_child_reads_as_popen_reads_it_and_wait_times_out_like_popen(tmp_path: Path, recorder: str) -> None:
    sleeper = tmp_path / "fork_sleeper.py"
    sleeper.write_text("import time\ntime.sleep(60)\n")
    child = fork_module([sys.executable, "-m", "fork_sleeper"], dict(os.environ), str(tmp_path), lambda: None)
    assert child is not None and child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.1)
    child.kill()
    assert child.wait(timeout=30) == -9  # Popen's code for SIGKILL
    child.kill()  # a dead child: nothing to do, no error


def test_an_error_in_the_child_is_printed_and_exits_1(tmp_path: Path, recorder: str) -> None:
    (tmp_path / "fork_raiser.py").write_text("raise ValueError('bad')\n")
    result = subprocess.run(
        [sys.executable, "-c", FORK_AND_REPORT, "fork_raiser", str(tmp_path)], capture_output=True, text=True
    )
    assert result.stdout.strip() == "1", result.stderr
    assert result.stderr.rstrip().endswith("ValueError: bad")


# In a fresh process (one thread): fork the module, print its exit code.
FORK_AND_REPORT = """
import os, sys
sys.path.insert(0, sys.argv[2])
from disttrain.launch.fork import fork_module
child = fork_module([sys.executable, "-m", sys.argv[1]], dict(os.environ), sys.argv[2], lambda: None)
print(child.wait(timeout=60))
"""


def test_no_fork_beside_another_thread_or_for_a_command_that_is_not_a_module(tmp_path: Path) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert fork_module([sys.executable, "-m", "json.tool"], dict(os.environ), str(tmp_path), lambda: None) is None
    finally:
        stop.set()
        thread.join()
    assert fork_module([sys.executable, "-c", "pass"], dict(os.environ), str(tmp_path), lambda: None) is None


def test_a_process_that_imported_torch_or_tokenizers_has_touched_their_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delitem(sys.modules, "tokenizers", raising=False)
    assert pools_untouched()
    monkeypatch.setitem(sys.modules, "tokenizers", object())
    assert not pools_untouched()


@pytest.mark.parametrize(
    ("accelerator", "pools", "forks"), [("cpu", True, True), ("gpu", True, False), ("cpu", False, False)]
)
def test_only_a_cpu_job_whose_process_has_not_touched_a_pool_forks_its_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accelerator: str, pools: bool, forks: bool
) -> None:
    for key in ("LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "RANK", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    prepared = preflight([*TINY_MODEL, f"hydra.run.dir={tmp_path / 'run'}"], CONF).prepared
    assert prepared is not None
    run_cfg = prepared.run_cfg
    prepared = replace(prepared, run_cfg=replace(run_cfg, hw=replace(run_cfg.hw, accelerator=accelerator)))
    monkeypatch.setattr(launcher_module, "pools_untouched", lambda: pools)
    monkeypatch.setattr(launcher_module, "start_local_ranks", lambda *args: pytest.fail("started as new interpreters"))
    launcher = Launcher.of_this_process(prepared, tmp_path, "train", [])
    if forks:  # the ranks wait for this process's imports
        launcher.start_before_imports()
        assert launcher.forks and launcher.kind() is LaunchKind.FORK
    else:
        with pytest.raises(pytest.fail.Exception, match="new interpreters"):
            launcher.start_before_imports()
        assert not launcher.forks and launcher.kind() is LaunchKind.EXEC
    unchecked = Launcher.of_this_process(None, tmp_path, "train", [])
    unchecked.start_before_imports()  # a multirun's job: its ranks start when it spawns them
    assert not unchecked.forks


# In a fresh process: check a command as the launcher does, then say whether a fork-unsafe pool could exist.
CHECK_THEN_ASK = """
import sys
from pathlib import Path
from disttrain.job.preflight import preflight
from disttrain.launch.fork import pools_untouched
preflight(sys.argv[2:], Path(sys.argv[1]))
print(pools_untouched())
"""


USER_MODEL_AND_DATA = ["~model", "+model._target_=tests.plugins.BigramModel", "+model.vocab_size=10",
                       "+model.seq_len=16", "~data", "+data._target_=tests.plugins.CountingData"]  # fmt: skip


@pytest.mark.parametrize("model", [["model=gpt-nano"], ["model=moe-micro"], USER_MODEL_AND_DATA], ids=str)
def test_checking_a_command_leaves_the_launcher_able_to_fork(tmp_path: Path, model: list[str]) -> None:
    """The saving rests on this: were the checks of the command to import torch, every CPU launch would start its
    ranks as new interpreters again (safe, and seconds of CPU per rank slower). A user's model and datamodule import
    torch, so their checks run in the job (job/run.py), not here: a short user-model launch took 13.5 s instead of
    8.2 s while they ran here."""
    command = [sys.executable, "-c", CHECK_THEN_ASK, str(CONF), *model, f"hydra.run.dir={tmp_path / 'run'}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "True", result.stderr[-2000:]
