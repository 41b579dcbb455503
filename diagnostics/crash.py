"""The crash-record contract: each rank that raises writes ``RUN_DIR/failure_rank<N>.json`` before it exits.

A distributed run that fails shows the same failure several times: the rank that raised, and every other rank
whose next collective then fails because its peer went away ("Connection closed by peer" from gloo, a broken
NCCL communicator). Each rank records its own error with the step and phase it was in; ``primary_crash`` tells
the cause from its echoes, from the files alone, so the launcher that reports the failure and
``python -m diagnose`` on a copied run dir name the same rank. Pure Python (no torch): both sides import it.
"""

from __future__ import annotations

import json
import os
import re
import time
import traceback
from pathlib import Path
from typing import Any

CRASH_FILE = re.compile(r"^failure_rank(\d+)\.json$")
# Where in a training step a rank was when it raised, as far as the collectors know (None: diagnostics off).
PHASES = ("data", "forward", "backward", "optimizer", "checkpoint", "validation", "other")
TRACEBACK_CHARS = 20_000  # a deep Lightning stack is ~10k characters; a recursion error is cut
# What a rank sees when a peer process died under it: these errors are echoes of another rank's failure.
PEER_FAILURE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "remote process exited",
    "remote worker crashing",
    "nccl communicator was aborted",
)
PEER_FAILURE_TYPES = ("DistNetworkError", "DistBackendError")
# A user's mistake found only once the ranks run (a datamodule's first batch): reported as the config error it is.
USER_ERROR_TYPES = ("ConfigError",)
# Engines that re-raise an error of the user's code inside one of their own, chained to it: torch's pipeline
# schedule reports a stage's error as "[Stage 1] failed to run forward:" and the arguments' shapes. The record
# names the cause (its type and first line); the traceback keeps the whole chain.
ENGINE_WRAPPERS = re.compile(r"\s*(\[Stage \d+\] failed to run (forward|backward)|Failed to run stage backward)")


def crash_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"failure_rank{rank}.json"


def first_line(error: BaseException) -> str:
    """``Type: first line of the message`` (the whole message can be pages long)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300]}" if text else type(error).__name__


def reported_error(error: BaseException) -> BaseException:
    """The error a failure is named by: ``error``, or the cause an engine's wrapper (``ENGINE_WRAPPERS``) hides."""
    while error.__cause__ is not None and ENGINE_WRAPPERS.match(str(error)):
        error = error.__cause__
    return error


def is_peer_failure(error_type: str, message: str) -> bool:
    """Whether an error only says that another rank went away (its cause is that rank's own error)."""
    lowered = message.lower()
    return error_type in PEER_FAILURE_TYPES or any(marker in lowered for marker in PEER_FAILURE_MARKERS)


def write_crash_record(
    run_dir: Path, rank: int, error: BaseException, step: int | None = None, phase: str | None = None
) -> Path | None:
    """Write this rank's crash record unless it has one (its first error is the cause); None when it had."""
    path = crash_path(run_dir, rank)
    if path.exists():
        return None
    cause = reported_error(error)
    text = str(cause).strip()
    record: dict[str, Any] = {
        "rank": rank,
        "t": time.time(),
        "exception": type(cause).__name__,
        "message": text.splitlines()[0][:300] if text else "",
        "error": first_line(cause),
        "peer_failure": is_peer_failure(type(cause).__name__, text),
        "step": step,
        "phase": phase,
        "traceback": _cut("".join(traceback.format_exception(type(error), error, error.__traceback__))),
        "pid": os.getpid(),
    }
    if type(cause).__name__ in USER_ERROR_TYPES:  # the whole one-line message: key, problem and fix
        record["user_error"] = text
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename: the launcher may read it while this rank is still exiting.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def _cut(trace: str) -> str:
    """The end of a long traceback (the frames that raised), still headed as one."""
    if len(trace) <= TRACEBACK_CHARS:
        return trace
    head = trace.splitlines(keepends=True)[0]
    return f"{head}  ... ({len(trace) - TRACEBACK_CHARS} characters of outer frames cut)\n{trace[-TRACEBACK_CHARS:]}"


def read_crash_records(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Every rank's crash record by rank (unreadable files are skipped: a rank killed mid-write)."""
    records: dict[int, dict[str, Any]] = {}
    for path in Path(run_dir).glob("failure_rank*.json"):
        match = CRASH_FILE.match(path.name)
        if not match:
            continue
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(record, dict):
            record["rank"] = int(match.group(1))
            record.setdefault("peer_failure", is_peer_failure(str(record.get("exception")), str(record.get("error"))))
            records[record["rank"]] = record
    return records


def primary_crash(records: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The record of the rank whose own error stopped the run: the earliest that is not a peer's echo, None if
    every record is an echo (the rank that failed first was killed without writing one)."""
    causes = [r for r in records.values() if not r.get("peer_failure")]
    if not causes:
        return None
    return min(causes, key=lambda r: (_number(r.get("t")), r["rank"]))


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else float("inf")


def describe_site(step: Any, phase: Any) -> str:
    """'in forward of step 8', 'at step 8', or '' when neither is known."""
    if isinstance(phase, str) and phase and phase != "other" and isinstance(step, int):
        return f"in {phase} of step {step}"
    if isinstance(step, int):
        return f"at step {step}"
    return ""


def raised_at(trace: str) -> str | None:
    """``file:line in function`` of the innermost frame of a formatted traceback."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', trace or "")
    if not frames:
        return None
    path, line, function = frames[-1]
    return f"{path}:{line} in {function}"


def retire_crash_records(run_dir: Path) -> None:
    """Rename an earlier attempt's records in this run dir (a restart) to ``failure_rank<N>.earlier.json``: only
    this attempt's errors may name the cause of its failure."""
    for path in Path(run_dir).glob("failure_rank*.json"):
        if CRASH_FILE.match(path.name):
            os.replace(path, path.with_name(f"{path.stem}.earlier.json"))
