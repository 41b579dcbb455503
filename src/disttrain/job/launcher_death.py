"""Rank 0 of a local launch dies (SIGKILL, the out-of-memory killer): its ranks record the failure it cannot.

Rank 0 is the launcher: it names a dead rank in run.json, writes the report and ends the console. When it dies
itself, nothing of it is left to do so. Each rank it spawned has a thread waiting on rank 0's pidfd
(``launch/local.py``), woken when it exits, after which the rank goes down at once, as it always did: nothing is
left waiting in a collective. First, the rank that claims the report starts this module as a process of its
own: torch-free, it starts in a fraction of a second and outlives the rank. It marks run.json failed naming
rank 0 (unless rank 0 had recorded an end itself: a hang, an error, a stop), writes failure.json and the
report, and ends the console with the line any other rank's death gets. The exit code the shell sees stays
rank 0's own: 137 for SIGKILL.

Nothing of this runs while rank 0 lives: the waiting thread costs nothing. Under the restart supervisor
(``trainer.max_restarts``) the supervisor sees rank 0 die and restarts the job; the ranks die by
PR_SET_PDEATHSIG without a word, as before.

A 1-process run has no rank to do this: it starts the same reporter at once, waiting on the run's process
(``watch_this_process``; ``--watch PID``), and ends it when the job ends by itself (``stop_watching``). One
sleeping torch-free process per 1-process job; it acts only if the run dies with run.json still ``running``.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from diagnostics.manifest import RunManifest, read_manifest
from diagnostics.report import diagnose_run
from disttrain.job.sweeps import write_failure
from disttrain.launch.local import describe_exit, exit_status_of_dead_process

CLAIM_FILE = ".launcher-death-reported"  # the first rank to create it reports; the others just exit
REPORTER_START_TRIES = 2
REPORT_TIME_LIMIT_S = 120  # the reporter must not outlive the job for long, whatever happens to it


def report_launcher_death(run_dir: Path, parent_pid: int) -> None:
    """In a spawned rank whose launcher (rank 0) just died: start the reporter unless another rank has."""
    code = exit_status_of_dead_process(parent_pid)
    try:
        os.close(os.open(Path(run_dir) / CLAIM_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return  # another rank reports it
    except OSError:
        return  # the run dir is gone: nothing to record into
    command = [sys.executable, "-m", "disttrain.job.launcher_death", str(run_dir), "" if code is None else str(code)]
    # This rank's other threads are unwinding a collective that lost rank 0 while this one starts the reporter:
    # vfork's child shares their memory until its exec, and once read exec's arguments as they changed (EFAULT,
    # "Bad address", seen in CI). A plain fork copies the memory first; the rank exits right after, so the copy of
    # its address space costs nothing that matters. A second try for any other transient failure.
    subprocess._USE_VFORK = False  # type: ignore[attr-defined]
    for attempt in range(REPORTER_START_TRIES):
        try:
            subprocess.Popen(command, stdin=subprocess.DEVNULL)
            return
        except OSError as err:
            if attempt + 1 == REPORTER_START_TRIES:  # say so: otherwise the job would end without a word
                why = f"{describe_launcher_death(code)}; could not record it: {err}"
                print(f"disttrain: {why}", file=sys.stderr, flush=True)


def describe_launcher_death(code: int | None) -> str:
    """'rank 0 died (killed by SIGKILL)'; without its exit status (its parent reaped it first), what is known."""
    how = describe_exit(code) if code is not None else "its process ended without ending the job"
    return f"rank 0 died ({how})"


def record_launcher_death(run_dir: Path, code: int | None) -> str | None:
    """Mark run.json failed naming rank 0 and write failure.json; None when rank 0 had recorded an end itself."""
    manifest = read_manifest(run_dir)[0] or RunManifest()  # none yet: it died before it had recorded the run
    if manifest.status != "running":
        return None  # rank 0 ended the run itself (it killed its ranks after recording why)
    failure = describe_launcher_death(code)
    manifest.failed(failure, 0).write(run_dir)
    error = describe_exit(code) if code is not None else "ended without ending the job"
    write_failure(run_dir, {"error": error, "source": "rank 0", "rank": 0, "traceback": ""})
    return failure


def wants_report(run_dir: Path) -> bool:
    """Whether the run writes a report (``diagnostics.enabled`` and ``diagnostics.report`` in run.json's config)."""
    manifest = read_manifest(run_dir)[0]
    diagnostics = manifest.config.get("diagnostics") if manifest is not None else None
    if not isinstance(diagnostics, dict):
        return False
    return bool(diagnostics.get("enabled", True) and diagnostics.get("report", True))


def watch_this_process(run_dir: Path) -> subprocess.Popen | None:
    """A 1-process run: start the reporter now, waiting on this process (None if it cannot be started)."""
    command = [sys.executable, "-m", "disttrain.job.launcher_death", "--watch", str(os.getpid()), str(run_dir)]
    try:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL)
    except OSError:
        return None  # the run goes on; only a death of this process would go unrecorded


def stop_watching(watcher: subprocess.Popen | None) -> None:
    """The job ended by itself (completed, failed or stopped, each recorded by the run): end its reporter."""
    if watcher is not None and watcher.poll() is None:
        watcher.kill()
        watcher.wait()


def wait_for_death(pid: int) -> int | None:
    """Block until process ``pid`` (this one's parent) exits; how it ended, while it is not reaped yet."""
    try:
        pidfd = os.pidfd_open(pid)  # type: ignore[attr-defined]
    except ProcessLookupError:
        return None
    except (AttributeError, OSError):  # no pidfd here: poll whether the parent is still ours
        while os.getppid() == pid:
            time.sleep(1.0)
        return exit_status_of_dead_process(pid)
    select.select([pidfd], [], [])
    return exit_status_of_dead_process(pid)


def main(argv: list[str]) -> int:
    """``python -m disttrain.job.launcher_death RUN_DIR [EXIT_STATUS]`` (started by a rank, see the module doc), or
    ``--watch PID RUN_DIR`` (started by a 1-process run: wait for PID to exit first)."""
    if argv[:1] == ["--watch"]:
        # Ctrl-C reaches every process of the terminal's foreground group: this one must outlive the run it records.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        code = wait_for_death(int(argv[1]))
        run_dir = Path(argv[2])
    else:
        run_dir = Path(argv[0])
        code = int(argv[1]) if len(argv) > 1 and argv[1].lstrip("-").isdigit() else None
    signal.alarm(REPORT_TIME_LIMIT_S)
    failure = record_launcher_death(run_dir, code)
    if failure is None:
        return 0
    where = ""
    if wants_report(run_dir):
        try:
            report = diagnose_run(run_dir)
            where = f"; report: {report.written_to / 'report.md'}" if report.written_to else ""
        except Exception as err:  # the record above is what matters; say why there is no report
            print(f"disttrain: could not write the diagnostics report: {type(err).__name__}: {err}", file=sys.stderr)
    print(f"disttrain: {failure}; stopping the job{where}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
