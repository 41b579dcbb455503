"""A failed run names its cause: the rank that raised (or died), its error, the step and the phase.

Every rank that raises writes its own crash record (``diagnostics/crash.py``) before it exits; the process that
reports the job's failure (rank 0 of a local launch, or a 1-process run) reads the records, picks the rank whose
own error it was (not a peer that only saw the connection close), records it in run.json and failure.json,
writes the report, prints that rank's traceback once and ends with one line. Survivors' echoes go to their logs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from diagnostics.crash import (
    describe_site,
    first_line,
    is_peer_failure,
    primary_crash,
    read_crash_records,
    reported_error,
    write_crash_record,
)
from diagnostics.manifest import RunManifest
from disttrain.config.errors import USER_ERROR_EXIT_CODE, ConfigError
from disttrain.job.disk_full import disk_full_failure
from disttrain.job.report import say_report
from disttrain.job.sweeps import TRACEBACK_CHARS, write_failure
from disttrain.launch.env import process_role, say
from disttrain.launch.exit_codes import FAILED, RunStopped
from disttrain.launch.local import LocalRanks, await_parent_death, describe_exit
from disttrain.reliability.sigterm import signalled_rank

# How long a spawned rank whose peer connection broke waits for rank 0's exit to be seen before it gives up: under
# load a SIGKILLed rank 0 can take seconds to finish exiting. Costs nothing when the lost peer was another rank
# (rank 0 then ends this rank itself, at once).
PEER_LOSS_WAIT_S = 15.0

if TYPE_CHECKING:
    from disttrain.training.build import TrainerParts


@dataclass
class FailureReporting:
    """What the failure path of one job needs: where to write, run.json's content so far, whether to write the
    report, and a lock so that the main thread and the rank watcher report a failure once between them."""

    run_dir: Path
    manifest: RunManifest
    report: bool
    # Whether this process reports the job's failure: the launcher or a 1-process run, decided before local ranks
    # are spawned (spawning sets the launcher's own NODE_RANK, after which it looks like a cluster task).
    reports: bool
    lock: threading.Lock = field(default_factory=threading.Lock)


def record_crash(run_dir: Path, error: BaseException, parts: TrainerParts | None) -> None:
    """This rank's crash record: its error, and the step and phase it was in as far as known."""
    step = phase = None
    if parts is not None:
        trainer = parts.trainer
        step = trainer.global_step + 1  # the step that did not finish (Lightning has left its training state here)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if hasattr(callback, "crash_site"):  # the diagnostics callback knows the phase
                step, phase = callback.crash_site(trainer)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if getattr(callback, "saving_step", None) is not None:  # a step checkpoint's save raised
                step, phase = callback.saving_step, "checkpoint"
    with contextlib.suppress(Exception):  # the error itself must still reach the user
        write_crash_record(run_dir, process_role().global_rank, error, step, phase)


def log_to_own_file(run_dir: Path, text: str) -> None:
    """Append ``text`` to this process's log file (Hydra's job log: train.log, train_rank<N>.log), not the console."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    record = logging.LogRecord("disttrain", logging.ERROR, __file__, 0, text.rstrip("\n"), None, None)
    for handler in files:
        handler.handle(record)
    if not files:  # Hydra's logging switched off
        with contextlib.suppress(OSError), (run_dir / f"train_rank{process_role().global_rank}.log").open("a") as log:
            log.write(text)


def stop_for_failure(
    failure_reporting: FailureReporting,
    ranks: LocalRanks | None,
    dead: list[tuple[int, int]] | None,
    own_error: BaseException | None,
) -> RunStopped:
    """Name the rank whose error stopped the job, from the ranks' crash records; record it in run.json and
    failure.json, write the report, print that rank's traceback once (the others' echoes go to their logs) and
    return the stop whose one-line message ends the console."""
    run_dir, manifest = failure_reporting.run_dir, failure_reporting.manifest
    own_rank = process_role().global_rank
    if ranks is not None:
        if dead is None:
            # A peer's connection closing means it is exiting: wait for it, and for its crash record.
            peer_left = own_error is not None and is_peer_failure(type(own_error).__name__, str(own_error))
            dead = ranks.dead(wait_s=30.0 if peer_left else 3.0)
        ranks.kill()
    cause = primary_crash(read_crash_records(run_dir))
    if cause is not None and cause.get("user_error"):
        return stop_for_user_error(failure_reporting, cause, own_error)
    details: dict[str, Any]
    full = disk_full_failure(own_error, run_dir)
    if full is not None:  # the disk, not a rank: every rank failed writing, and none could record why
        rank, error, trace, details, failure = own_rank, full, "", {"exception": "OSError"}, full
    elif cause is not None:
        rank, error, trace = cause["rank"], cause["error"], cause.get("traceback") or ""
        site = describe_site(cause.get("step"), cause.get("phase"))
        failure = f"rank {rank} raised " + (f"{site}: " if site else "") + error
        details = {"exception": cause.get("exception"), "step": cause.get("step"), "phase": cause.get("phase")}
    elif dead:
        rank, code = dead[0]
        error, trace, details = describe_exit(code), "", {}
        failure = f"rank {rank} died ({error})"
    else:
        assert own_error is not None, "a failure without a dead rank is this process's own error"
        rank, raised = own_rank, reported_error(own_error)
        error, details = first_line(raised), {"exception": type(raised).__name__}
        trace = "".join(traceback.format_exception(own_error))
        failure = f"rank {rank} raised {error}"
    echo = cause["rank"] != own_rank if cause is not None else bool(dead)  # else the failure is this rank's own
    if own_error is not None and echo:
        log_to_own_file(run_dir, "".join(traceback.format_exception(own_error)))  # an echo of the failure
    with contextlib.suppress(Exception):  # the job must end whatever happens here
        manifest.failed(failure, rank, **details).write(run_dir)
        source = f"rank {rank}" + (" (local rank started by rank 0)" if rank else "")
        write_failure(run_dir, {"error": error, "source": source, "rank": rank, "traceback": trace[-TRACEBACK_CHARS:]})
    where = ""
    if failure_reporting.report:
        report = say_report(run_dir, quiet=True)
        where = f"; report: {report.written_to / 'report.md'}" if report and report.written_to else ""
    if trace:
        say(trace.rstrip("\n"), file=sys.stderr)
    return RunStopped(FAILED, f"disttrain: {failure}; stopping the job{where}")


def stop_for_user_error(
    failure_reporting: FailureReporting, cause: dict, own_error: BaseException | None
) -> RunStopped:
    """A config error a rank found at run time (every rank may find the same one): recorded as the run's failure and
    said once, as the one line a config error is before launch, with its exit code; no traceback, no report."""
    run_dir, rank, message = failure_reporting.run_dir, cause["rank"], cause["user_error"]
    if own_error is not None and cause["rank"] != process_role().global_rank:
        log_to_own_file(run_dir, "".join(traceback.format_exception(own_error)))  # an echo of the failure
    with contextlib.suppress(Exception):  # the job must end whatever happens here
        failure_reporting.manifest.failed(f"rank {rank}: config error: {message}", rank).write(run_dir)
        write_failure(run_dir, {"error": f"config error: {message}", "source": f"rank {rank}", "rank": rank,
                                "traceback": ""})  # fmt: skip
    return RunStopped(USER_ERROR_EXIT_CODE, f"disttrain: config error: {message}")


def interrupting_signal(error: BaseException) -> signal.Signals | None:
    """The signal behind an error that ended fit, if any: Lightning turns SIGTERM into ``SIGTERMException`` (a
    SystemExit without a code, which would exit 0) and Ctrl-C into ``sys.exit(1)`` while handling the
    KeyboardInterrupt."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    if isinstance(error, SIGTERMException):
        return signal.SIGTERM
    if isinstance(error, KeyboardInterrupt) or (
        isinstance(error, SystemExit) and isinstance(error.__context__, KeyboardInterrupt)
    ):
        return signal.SIGINT
    return None


def stop_for_signal(failure_reporting: FailureReporting, signum: signal.Signals, rank: int = 0) -> RunStopped:
    """A run ended by a signal it could catch (a 1-process run's, or the one ``rank`` of a local launch received
    and every rank agreed to stop for): record it as that rank's failure (run.json, failure.json, the report) and
    end with 128+N, the status a shell gives a process that signal ended."""
    run_dir, manifest = failure_reporting.run_dir, failure_reporting.manifest
    failure = f"rank {rank} stopped by {signum.name}"
    record = {"error": f"stopped by {signum.name}", "source": f"rank {rank}", "rank": rank, "traceback": ""}
    with contextlib.suppress(Exception):  # the job must end whatever happens here
        manifest.failed(failure, rank).write(run_dir)
        write_failure(run_dir, record)
    where = ""
    if failure_reporting.report:
        report = say_report(run_dir, quiet=True)
        where = f"; report: {report.written_to / 'report.md'}" if report and report.written_to else ""
    return RunStopped(128 + signum, f"disttrain: {failure}; stopping the job{where}")


def record_hang(failure_reporting: FailureReporting, hang: dict) -> None:
    """The hang watchdog fired (local rank 0, before it writes the report and ends the job with exit code 3): name
    the ranks that hung outside a collective (the others were waiting for them) in run.json and failure.json."""
    outside = hang.get("outside_collectives") or []
    rank = outside[0] if len(outside) == 1 else None
    who = f"rank {rank}" if rank is not None else f"ranks {outside}" if outside else "every rank (in a collective)"
    error = f"no step completed in {hang.get('timeout_s', 0):.0f} s after step {hang.get('last_step')}"
    failure = f"{who} hung: {error}" + (", outside any collective" if outside else "")
    run_dir, manifest = failure_reporting.run_dir, failure_reporting.manifest
    with contextlib.suppress(Exception):  # the watchdog must end the job whatever happens here
        manifest.failed(failure, rank, hung_ranks=list(outside)).write(run_dir)
        write_failure(run_dir, {"error": f"hang: {error}", "source": who, "rank": rank, "traceback": ""})


def rank_died(run_dir: Path, manifest: RunManifest, rank: int, code: int) -> str:
    """The one-line report of a dead rank; also marks the run failed in run.json (best effort)."""
    failure = f"rank {rank} died ({describe_exit(code)})"
    if manifest.recorded:
        with contextlib.suppress(Exception):  # the job must end whatever happens here
            dataclasses.replace(manifest, status="failed", failure=failure).write(run_dir)
    return f"disttrain: {failure}; stopping the job"


def stop_fit(
    err: BaseException, failures: FailureReporting, ranks: LocalRanks | None, parts: TrainerParts | None, child: bool
) -> NoReturn:
    """What ends a fit that raised ``err``, raised: the crash recorded and the failing rank named once (a spawned
    rank leaves that to the launcher), a caught signal recorded as one, a dead local rank named as the cause;
    a user's config error found at run time is said once like one found before launch; an agreed stop passes
    through as it is."""
    run_dir, manifest = failures.run_dir, failures.manifest
    crashed = isinstance(err, Exception) and not isinstance(err, RunStopped)
    if crashed:
        record_crash(run_dir, err, parts)
    if crashed and child:
        # The launcher prints the error of the rank that caused the failure, once: this one's goes to its log.
        log_to_own_file(run_dir, "".join(traceback.format_exception(err)))
        # The lost peer may be rank 0: its death is recorded first. An error not known as a peer's loss still
        # waits a moment, so that no wording of a lost connection leaves rank 0's death unrecorded.
        await_parent_death(timeout_s=PEER_LOSS_WAIT_S if is_peer_failure(type(err).__name__, str(err)) else 1.0)
        raise RunStopped(USER_ERROR_EXIT_CODE if isinstance(err, ConfigError) else FAILED) from None
    if crashed and failures.reports:
        failures.lock.acquire()  # if the rank watcher holds it, it is ending this process
        raise stop_for_failure(failures, ranks, None, err) from None
    if ranks is None and failures.reports and (signum := interrupting_signal(err)) is not None:
        raise stop_for_signal(failures, signum) from None  # else SIGTERM would exit 0 with run.json "running"
    signalled = signalled_rank(parts.nonfinite.riders) if parts is not None and parts.nonfinite else None
    if ranks is not None and failures.reports and signalled is not None and interrupting_signal(err) == signal.SIGTERM:
        ranks.wait()  # every rank agreed in the same vote and stops after the same batch
        raise stop_for_signal(failures, signal.SIGTERM, signalled) from None
    if ranks is None:
        raise err
    # A rank that died makes rank 0's next collective fail at once ("connection reset"): name the cause.
    dead = [] if isinstance(err, KeyboardInterrupt) else ranks.dead(wait_s=3.0)
    ranks.kill()
    if not dead:
        raise err
    message = rank_died(run_dir, manifest, *dead[0])
    if dead[0][1] > 0:  # it raised an exception of its own (printed above): rank 0's may be the same bug
        say(message, file=sys.stderr)
        raise err
    seen = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    raise RunStopped(1, f"{message} (rank 0 then failed with {seen})") from None
