"""Time the training loop spends outside its steps: validation and checkpoint writes.

Every other detector reads step records, and the collectors keep validation and checkpoint writes out of them (a
step's time is its training). A run that validates or saves often can lose most of its wall-clock time there with
every step healthy: gpt-nano on 2 CPU ranks, validating 16 batches and saving every 5 of 60 steps, took 64.9 s
against 34.4 s for the same run validating and saving only at its end, and the step-based report said nothing.

The loop's time is rank 0's wall clock from the start of its first recorded step to the end of its last; the
pauses are those that began inside it (the final validation and checkpoint, after the last step, are what the run
pays whatever its intervals: left out). A pause is a job's: the ranks end a save or a validation together (both
are collective), so each one counts its slowest rank's seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diagnostics.analysis.load import RunTelemetry, num
from diagnostics.analysis.stats import rounded

# The config keys whose interval sets how often each kind of pause comes (conf/trainer/default.yaml).
INTERVAL_KEYS = {"validation": "trainer.val_every_n_steps", "checkpoint": "trainer.ckpt_every_n_steps"}


@dataclass(frozen=True)
class PausedKind:
    count: int
    seconds: float


@dataclass(frozen=True)
class LoopTime:
    """Rank 0's training loop from its first recorded step's start to its last step's end."""

    loop_s: float
    steps: int  # optimizer steps trained in it
    paused: dict[str, PausedKind]  # by what: validation, checkpoint
    tokens_per_step: float | None

    @property
    def paused_s(self) -> float:
        return sum(p.seconds for p in self.paused.values())

    @property
    def share(self) -> float:
        return self.paused_s / self.loop_s if self.loop_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens over the loop's wall-clock time, pauses included: what the run delivers per second."""
        if not self.tokens_per_step or self.loop_s <= 0:
            return None
        return self.steps * self.tokens_per_step / self.loop_s

    def to_json(self) -> dict[str, Any]:
        return {
            "loop_s": rounded(self.loop_s),
            "steps": self.steps,
            "paused_s": rounded(self.paused_s),
            "share": rounded(self.share),
            "by_what": {w: {"count": p.count, "seconds": rounded(p.seconds)} for w, p in self.paused.items()},
            "loop_tokens_per_s": rounded(self.tokens_per_s),
        }


def loop_time(run: RunTelemetry) -> LoopTime | None:
    """The loop's span and its pauses; None without timed step records (older collectors, a one-step run)."""
    if not run.ranks:
        return None
    first_rank = run.ranks[min(run.ranks)]
    timed = [(s.step, s.start_t, s.step_s) for s in first_rank.steps if s.start_t and s.step_s is not None]
    if len(timed) < 2:
        return None
    first_step, start, _ = min(timed, key=lambda t: t[1])
    last_step = max(step for step, _, _ in timed)
    end = max(t + seconds for _, t, seconds in timed)
    events: dict[tuple[str, int, int], float] = {}  # (what, step, n-th of that kind at that step) -> seconds
    for tele in run.ranks.values():
        seen: dict[tuple[str, int], int] = {}
        for rec in tele.pauses:
            what, step, seconds = str(rec.get("what")), rec.get("step"), num(rec.get("seconds"))
            began = num(rec.get("start_t"))
            if not isinstance(step, int) or seconds is None or began is None:
                continue
            if not first_step <= step < last_step or not start <= began < end:
                continue  # before the measured loop, or the run's final validation and checkpoint
            nth = seen.get((what, step), 0)
            seen[(what, step)] = nth + 1
            key = (what, step, nth)
            events[key] = max(events.get(key, 0.0), seconds)
    paused: dict[str, PausedKind] = {}
    for (what, _, _), seconds in sorted(events.items()):
        held = paused.get(what, PausedKind(0, 0.0))
        paused[what] = PausedKind(held.count + 1, held.seconds + seconds)
    tokens = num(run.meta("tokens_per_step"))
    return LoopTime(end - start, last_step - first_step + 1, paused, tokens)
