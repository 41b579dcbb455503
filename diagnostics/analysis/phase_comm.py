"""Collectives a phase issues itself, split into transfer (what every rank pays) and waiting (for a later rank).

FSDP2's all-gathers and reduce-scatters, ZeRO's collectives, an MoE layer's all-to-alls and balancing all-reduce
run inside forward and backward, and the collectors time each call (``forward_comm_s``, ``backward_comm_s``, the
calls one by one in ``comm_calls_s``). A call lasts from this rank's arrival until the last rank has arrived and
the data has moved: the last rank to arrive measures only the transfer, every other rank adds its wait for it.
Every rank issues the same collectives in the same order, so a call's minimum over the ranks is its transfer, and
what a rank spent beyond the sum of those minima it spent waiting for a peer (a rank holding the hot experts, a
noisy neighbour, the scheduler): waiting, charged to the rank that arrived last, never communication.

Per call and not per step: on a shared host the ranks take turns being late (rank 0 waits at one call, rank 1 at
the next), so the minimum of the ranks' per-step sums still holds most of the waits (an ep=2 moe-micro run on
the 2-core box: 30 ms of a 110 ms step by per-step sums, 21 ms call by call). Records without the calls (older
collectors) fall back to the per-step minimum of the sums, an upper bound of the transfer.

Expert parallelism's all-to-alls are also recorded apart (``all_to_all_s``, ``all_to_all_calls_s``): their share
of the step is what the report shows beside the split.
"""

from __future__ import annotations

from dataclasses import dataclass

from diagnostics.analysis.load import RunTelemetry, StepRecord
from diagnostics.analysis.stats import mean, rounded, steady


@dataclass(frozen=True)
class TimedComm:
    """Means per steady step that every rank recorded (seconds)."""

    steps: int
    step_s: float  # the slowest rank's step
    transfer_s: float  # time inside the phases' collectives that every rank pays
    wait_s: dict[int, float]  # per rank: its time inside them beyond the transfer
    all_to_all_s: dict[int, float] | None  # per rank: its time inside expert all-to-alls (None: not recorded)
    all_to_all_transfer_s: float | None

    def shares(self) -> tuple[float, float]:
        """(transfer, mean waiting over the ranks) as shares of the step."""
        if self.step_s <= 0:
            return 0.0, 0.0
        return self.transfer_s / self.step_s, (mean(self.wait_s.values()) or 0.0) / self.step_s

    def all_to_all(self) -> dict[str, float] | None:
        """The all-to-alls' share of the step (mean over ranks), its transfer and its waiting; None if unrecorded."""
        if self.all_to_all_s is None or self.all_to_all_transfer_s is None or self.step_s <= 0:
            return None
        share = (mean(self.all_to_all_s.values()) or 0.0) / self.step_s
        transfer = min(share, self.all_to_all_transfer_s / self.step_s)
        return {"share": rounded(share, 3) or 0.0, "transfer": rounded(transfer, 3) or 0.0,
                "waiting": rounded(share - transfer, 3) or 0.0}  # fmt: skip


def _phase_comm(s: StepRecord) -> float | None:
    if s.forward_comm_s is None and s.backward_comm_s is None:
        return None
    return (s.forward_comm_s or 0.0) + (s.backward_comm_s or 0.0)


def call_minimum(calls: list[list[float]]) -> float | None:
    """Sum over calls of each call's minimum over the ranks; None when the ranks did not record the same calls."""
    if not calls or len({len(c) for c in calls}) != 1:
        return None
    return sum(min(column) for column in zip(*calls, strict=True))


def _transfer(rows: dict[int, StepRecord], totals: dict[int, float], key: str) -> float:
    """One step's transfer: call by call where every rank recorded the same calls, else the minimum of the sums."""
    calls = [getattr(s, key) for s in rows.values()]
    by_call = call_minimum(calls) if all(c is not None for c in calls) else None
    fallback = min(totals.values())
    return fallback if by_call is None else min(by_call, fallback)


def timed_comm(run: RunTelemetry) -> TimedComm | None:
    """Transfer and waiting inside the phases' timed collectives; None with fewer than two ranks timing them."""
    by_step: dict[int, dict[int, StepRecord]] = {}
    for rank, tele in run.ranks.items():
        for s in steady(tele.steps):
            if _phase_comm(s) is not None and s.step_s:
                by_step.setdefault(s.step, {})[rank] = s
    world = len(run.ranks)
    rows = [r for r in by_step.values() if len(r) == world]
    if world < 2 or not rows:
        return None
    transfer, step_s, all_to_all_transfer = [], [], []
    waits: dict[int, list[float]] = {}
    all_to_all: dict[int, list[float]] = {}
    for row in rows:
        totals = {r: _phase_comm(s) or 0.0 for r, s in row.items()}
        t = _transfer(row, totals, "comm_calls_s")
        transfer.append(t)
        step_s.append(max(s.step_s or 0.0 for s in row.values()))
        for r, total in totals.items():
            waits.setdefault(r, []).append(max(0.0, total - t))
        if all(s.all_to_all_s is not None for s in row.values()):
            exchanges = {r: s.all_to_all_s or 0.0 for r, s in row.items()}
            all_to_all_transfer.append(_transfer(row, exchanges, "all_to_all_calls_s"))
            for r, seconds in exchanges.items():
                all_to_all.setdefault(r, []).append(seconds)
    complete = len(all_to_all_transfer) == len(rows)
    return TimedComm(
        steps=len(rows),
        step_s=mean(step_s) or 0.0,
        transfer_s=mean(transfer) or 0.0,
        wait_s={r: mean(w) or 0.0 for r, w in sorted(waits.items())},
        all_to_all_s={r: mean(v) or 0.0 for r, v in sorted(all_to_all.items())} if complete else None,
        all_to_all_transfer_s=mean(all_to_all_transfer) if complete else None,
    )
