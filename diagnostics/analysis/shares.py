"""Where the step time goes, as shares of the job's step: the verdict line of the report.

compute + data + communication + waiting + bubble + host = 1. ``communication`` is the exposed transfer that
every rank pays (per step the minimum over ranks, see step_measures.step_transfer_fraction); ``waiting`` is the
rest of the ranks' comm wait, and of their time between steps beyond what every rank pays (a preemption
vote or logging sync holds the ranks that reach it first): time a rank waited for a slower one. Compute is
what remains, so a wait the collectors cannot separate counts as compute; the collectives a phase issues itself
(FSDP2's per-block ones, MoE all-to-alls) are timed call by call and split the same way (analysis/phase_comm).
On a GPU ``host`` is the profiled device's idle time that no data or communication wait explains (host clocks
time kernel launches there, not kernels).
"""

from __future__ import annotations

from diagnostics.analysis.load import RunTelemetry
from diagnostics.analysis.phase_comm import timed_comm
from diagnostics.analysis.stats import mean, present, ratio, rounded, steady
from diagnostics.analysis.step_measures import collective_comm_s, device_idle, profile_exposed, step_transfer_fraction
from diagnostics.analysis.summary import RankPhases, run_device
from diagnostics.kinds.host_overhead import shared_unattributed

SHARES = ("compute", "data", "communication", "waiting", "bubble", "host")


def step_shares(run: RunTelemetry, phases: list[RankPhases]) -> dict[str, float] | None:
    """Mean shares of the step over the ranks (None without step records)."""
    timed = [p for p in phases if p.step_s]
    if not timed:
        return None
    data = mean(ratio(p.data_wait_s or 0.0, p.step_s) for p in timed) or 0.0
    own_host = mean(ratio(p.other_median_s or 0.0, p.step_s) for p in timed) or 0.0
    host = min(shared_unattributed(run, phases).values(), default=0.0)  # what every rank pays between phases
    if run_device(run) == "gpu":
        # Host clocks time kernel launches there: the host's share is the device's unexplained idle time.
        host = own_host = device_idle(phases) or 0.0
    waits = present(ratio(p.comm_wait_s, p.step_s) for p in timed if p.comm_wait_s is not None)
    transfer = step_transfer_fraction(run)
    # Collectives timed inside forward and backward (FSDP2, ZeRO, MoE all-to-alls): block the rank on a host-timed
    # backend, so their transfer is communication and the rest of their time waiting (analysis/phase_comm).
    phase_comm = timed_comm(run)
    in_phase, in_phase_waiting = phase_comm.shares() if phase_comm is not None else (0.0, 0.0)
    if transfer is None and phase_comm is None:  # no comm wait records (one rank, old FSDP): the profile's share
        comm_s = collective_comm_s(phases)
        transfer = min(present(profile_exposed(p, comm_s) for p in phases), default=0.0)
    transfer = transfer or 0.0
    waiting = max(0.0, (mean(waits) or 0.0) - transfer) if waits else 0.0
    transfer, waiting = transfer + in_phase, waiting + in_phase_waiting
    waiting += max(0.0, own_host - host)  # held between steps by a collective that a slower rank reached later
    bubbles = [mean(s.bubble_fraction for s in steady(t.steps)) for t in run.ranks.values()]
    bubble = mean(present(bubbles)) or 0.0
    shares = {"data": data, "communication": transfer, "waiting": waiting, "bubble": bubble, "host": host}
    shares["compute"] = max(0.0, 1.0 - sum(shares.values()))
    return {k: rounded(shares[k], 3) or 0.0 for k in SHARES}
