"""``straggler``: one rank is slower and the others wait for it at every collective. No config lever moves a slow
host or device; the recommendation names the rank, its slow phase and where to look.
"""

from __future__ import annotations

from diagnostics.analysis import Finding
from diagnostics.analysis.context import RunContext
from diagnostics.kinds.levers import ALL_OF_IT, Recommendation, gain, no_lever

# Where to look, by the phase a rank is slow in.
SLOW_PHASE_HINTS = {
    "forward": "its compute (other processes: top / nvidia-smi, clocks and temperature: nvidia-smi -q -d "
    "PERFORMANCE, CPU/NUMA binding) or rank-dependent work in the model's forward",
    "backward": "its compute (other processes, clocks, CPU/NUMA binding) or rank-dependent work in backward hooks",
    "optimizer": "its optimizer step (CPU offload, gradient clipping or hooks that run on this rank only)",
    "other": "work between steps on this rank only: logging, checkpoint writes, callbacks, rank-0-only hooks",
}


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    slow = finding.evidence.get("slow_phase_by_rank") or {}
    rank = max(finding.ranks, key=lambda r: (finding.evidence.get("falls_behind_s_per_step") or {}).get(r, 0.0))
    host = (finding.evidence.get("hostnames") or {}).get(rank)
    phase = slow.get(rank) or finding.evidence.get("slow_phase") or "forward"
    where = f"rank {rank}" + (f" on host {host}" if host else "")
    why = (
        f"{where} is slow in {phase} while the others wait for it; check {SLOW_PHASE_HINTS.get(phase, phase)}, and "
        "exclude a slow host (sbatch --exclude) if it stays slow"
    )
    expected = gain(finding, ALL_OF_IT, "the time the others wait for it per step")
    return [no_lever(why, "every rank at the others' pace").gaining(expected)]
