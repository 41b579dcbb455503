"""The guard against CPython's fork deadlock (gh-112275): which Pythons have it, a worker stuck inside its fork is
killed and forked again (stuck on purpose here: an at-fork child hook that never returns, where the real one waits
on the interpreter's lock), a worker that dies on its own is not, and every strategy gives its loaders the guard.

Forks with hooks run in a fresh interpreter (an at-fork hook cannot be removed from pytest's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from disttrain.reliability import fork_guard
from disttrain.reliability.fork_guard import CONFIRMED_FORK, fork_can_deadlock, guard_dataloader
from disttrain.strategies.ddp import HookedDDPStrategy, OneProcessStrategy
from disttrain.strategies.deepspeed import CPUCapableDeepSpeedStrategy
from disttrain.strategies.fsdp import FSDPStrategy
from disttrain.strategies.loaders import ForkGuardedLoaders
from disttrain.strategies.megatron.lightning import MegatronStrategy
from tests.conftest import REPO


@pytest.mark.parametrize(
    ("version", "affected"),
    [
        ((3, 11, 7), True),
        ((3, 11, 9), True),
        ((3, 11, 10), False),
        ((3, 10, 14), True),
        ((3, 10, 15), False),
        ((3, 9, 19), True),
        ((3, 12, 0), False),
        ((3, 13, 2), False),
    ],
)
def test_which_pythons_can_deadlock_in_a_fork(version: tuple[int, int, int], affected: bool) -> None:
    assert fork_can_deadlock(version) is affected


# A child fork hook that stalls the first child only (the marker file names it), then lets the next ones through;
# "always" stalls every child, "die" makes the first child exit 3 before it can confirm.
SCRIPT = """
import json, os, sys, time
from pathlib import Path
from disttrain.reliability import fork_guard

marker = Path(sys.argv[1]); mode = sys.argv[2]
fork_guard._ConfirmedForkPopen.confirm_timeout_s = float(sys.argv[3])
fork_guard._ConfirmedForkPopen.attempts = 2

def in_child():
    if mode == "always" or not marker.exists():
        with marker.open("a") as f:
            f.write(f"{os.getpid()}\\n")
        if mode == "die":
            os._exit(3)
        time.sleep(3600)

os.register_at_fork(after_in_child=in_child)

def work(path):
    Path(path).write_text("ran")

out = marker.with_suffix(".out")
process = fork_guard.CONFIRMED_FORK.Process(target=work, args=(str(out),))
try:
    process.start()
    process.join(30)
    result = {"exitcode": process.exitcode, "ran": out.exists()}
except fork_guard.ForkNeverConfirmed as err:
    result = {"error": str(err)}
stalled = [int(p) for p in marker.read_text().split()]
result["stalled_alive"] = [p for p in stalled if Path(f"/proc/{p}").exists()]
result["reforked"] = fork_guard._ConfirmedForkPopen.reforked
print(json.dumps(result))
"""


def run_script(tmp_path: Path, mode: str, timeout_s: float) -> tuple[dict, str]:
    marker = tmp_path / "stalled"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(marker), mode, str(timeout_s)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="the fork start method")
def test_a_worker_stuck_in_its_fork_is_killed_and_forked_again(tmp_path: Path) -> None:
    result, stderr = run_script(tmp_path, "once", 3.0)
    assert result["exitcode"] == 0 and result["ran"], result
    assert result["reforked"] == 1 and result["stalled_alive"] == [], result
    assert stderr.count("gh-112275") == 1 and "forked again" in stderr


@pytest.mark.skipif(sys.platform != "linux", reason="the fork start method")
def test_workers_that_never_start_end_in_an_error_naming_the_bug_and_the_fix(tmp_path: Path) -> None:
    result, _ = run_script(tmp_path, "always", 1.0)
    assert "gh-112275" in result["error"] and "forkserver" in result["error"] and "3.11.10" in result["error"]
    assert result["reforked"] == 2 and result["stalled_alive"] == [], result


@pytest.mark.skipif(sys.platform != "linux", reason="the fork start method")
def test_a_worker_that_dies_on_its_own_is_not_forked_again(tmp_path: Path) -> None:
    result, _ = run_script(tmp_path, "die", 10.0)
    assert result["exitcode"] == 3 and not result["ran"] and result["reforked"] == 0, result


def loader(**kwargs: object) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(12.0)), batch_size=3, **kwargs)  # type: ignore[arg-type]


def test_loaders_that_fork_their_workers_get_the_guard_and_the_others_are_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fork_guard, "fork_can_deadlock", lambda: True)
    monkeypatch.setattr(fork_guard, "default_start_method", lambda: "fork")
    assert guard_dataloader(loader(num_workers=2)).multiprocessing_context is CONFIRMED_FORK
    assert guard_dataloader(loader()).multiprocessing_context is None
    spawn = guard_dataloader(loader(num_workers=2, multiprocessing_context="spawn"))
    assert spawn.multiprocessing_context.get_start_method() == "spawn"
    not_a_loader = object()
    assert guard_dataloader(not_a_loader) is not_a_loader
    monkeypatch.setattr(fork_guard, "default_start_method", lambda: "forkserver")
    assert guard_dataloader(loader(num_workers=2)).multiprocessing_context is None
    monkeypatch.setattr(fork_guard, "default_start_method", lambda: "fork")
    monkeypatch.setattr(fork_guard, "fork_can_deadlock", lambda: False)
    assert guard_dataloader(loader(num_workers=2)).multiprocessing_context is None


@pytest.mark.skipif(sys.platform != "linux", reason="the fork start method")
def test_guarded_workers_give_the_same_batches_in_the_same_order() -> None:
    guarded = loader(num_workers=2)
    guarded.multiprocessing_context = CONFIRMED_FORK
    assert [b[0].tolist() for b in guarded] == [b[0].tolist() for b in loader()]


@pytest.mark.parametrize(
    "strategy", [HookedDDPStrategy, OneProcessStrategy, FSDPStrategy, CPUCapableDeepSpeedStrategy, MegatronStrategy]
)
def test_every_strategy_guards_its_loaders(strategy: type) -> None:
    assert ForkGuardedLoaders in strategy.__mro__


def test_a_strategy_hands_lightning_the_guarded_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fork_guard, "fork_can_deadlock", lambda: True)
    monkeypatch.setattr(fork_guard, "default_start_method", lambda: "fork")
    processed = HookedDDPStrategy().process_dataloader(loader(num_workers=2))
    assert processed.multiprocessing_context is CONFIRMED_FORK
