"""``python -m train`` ends through process_exit.run_then_exit: same status as Python's, nothing owed is lost."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROGRAM = """
import atexit, concurrent.futures, logging, logging.handlers, sys, threading, time
from pathlib import Path
from disttrain.launch.process_exit import run_then_exit

out = Path(sys.argv[1])
pools = []
# Holds records until closed: only logging.shutdown() writes them.
held = logging.handlers.MemoryHandler(capacity=1000, target=logging.FileHandler(out / "log.txt"))
logging.basicConfig(handlers=[held], level=logging.INFO)

def slow_writer():
    time.sleep(0.3)
    (out / "thread.txt").write_text("joined")

def entry():
    atexit.register(lambda: (out / "atexit.txt").write_text("ran"))
    threading.Thread(target=slow_writer).start()  # not a daemon: must be waited for
    # A pool never shut down (torch.compile leaves one): its idle workers must be woken, not waited for forever.
    pools.append(concurrent.futures.ThreadPoolExecutor(2))  # kept alive, as a library's global pool is
    pools[-1].submit(time.sleep, 0.1)
    logging.getLogger("job").info("logged line")
    sys.stdout.write("buffered, no newline")  # a pipe is block-buffered: only a flush delivers this
    {ending}

run_then_exit(entry)
"""


def run_program(ending: str, tmp_path: Path) -> subprocess.CompletedProcess:
    source = textwrap.dedent(PROGRAM).replace("{ending}", ending)
    return subprocess.run([sys.executable, "-c", source, str(tmp_path)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("ending", "code", "on_stderr"),
    [
        ("return None", 0, ""),
        ("sys.exit(None)", 0, ""),
        ("sys.exit(4)", 4, ""),
        ("sys.exit('disttrain: a message')", 1, "disttrain: a message"),
        ("raise ValueError('boom')", 1, "ValueError: boom"),
        ("raise KeyboardInterrupt", 130, "KeyboardInterrupt"),
    ],
)
def test_status_is_pythons_and_nothing_owed_is_lost(ending: str, code: int, on_stderr: str, tmp_path: Path) -> None:
    result = run_program(ending, tmp_path)
    assert result.returncode == code, result.stderr
    assert on_stderr in result.stderr
    if "raise" in ending:
        assert "Traceback" in result.stderr
    assert result.stdout == "buffered, no newline"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "thread.txt").read_text() == "joined"
    assert "logged line" in (tmp_path / "log.txt").read_text()
