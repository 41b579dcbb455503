"""Right rank, right cause: a rank slow in each phase, on rank 0 and on rank 1, under DDP and FSDP.

One spawned run per strategy holds the ten scenarios in consecutive step ranges (tests.plugins.phase_plan);
each range is cut out of the recorded telemetry and analysed on its own, as ``python -m diagnose`` would.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diagnostics.analysis import load_run
from diagnostics.diagnosis import analyse
from tests.conftest import REPO, run_cli
from tests.diag_fixtures import slice_steps
from tests.plugins import PHASE_FIRST_STEP, PHASE_SEGMENT_STEPS, SLOW_PHASES, phase_plan

pytestmark = [pytest.mark.dist, pytest.mark.exclusive]  # diagnoses where time goes: run alone

STEPS = PHASE_FIRST_STEP + len(SLOW_PHASES) * 2 * PHASE_SEGMENT_STEPS + 4
PHASE_RUN = [
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=10",
    f"trainer.val_every_n_steps={STEPS}",
    "trainer.val_batches=1",
    "trainer.micro_batch_size=4",
    "optimizer.lr=0.05",
    "optimizer.warmup_steps=2",
    "diagnostics.profile=false",
    "diagnostics.sample_interval_s=0.5",
    "~model",
    "+model.vocab_size=10",
    "+model.seq_len=16",
    "+model._target_=tests.plugins.PhaseSlowModel",
    "~data",
    "+data._target_=tests.plugins.PhaseSlowData",
]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_slow_rank_is_named_with_its_phase_and_the_waiting_rank_never(tmp_path: Path, strategy: str) -> None:
    run_dir = tmp_path / "run"
    result = run_cli([f"strategy={strategy}", *PHASE_RUN, f"hydra.run.dir={run_dir}"], cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if strategy == "fsdp":  # FSDP2's collectives are timed inside the phases that issue them (collect/fsdp_comm)
        steps = [s for tele in load_run(run_dir).ranks.values() for s in tele.steps]
        assert all(s.forward_comm_s is not None and s.backward_comm_s is not None for s in steps)
        assert all(s.forward_comm_s > 0 for s in steps), "the root's all-gather opens every forward"
    for phase, rank, first, last in phase_plan():
        # Records are numbered by global_step after the step; the first record of a range can still carry the
        # previous scenario's tail (a prefetched batch), so it is left out.
        case = f"{strategy}: rank {rank} slow in {phase}"
        findings = analyse(slice_steps(run_dir, first + 2, last + 1, tmp_path / f"{phase}{rank}")).findings
        named = {f.kind: f for f in findings if f.kind in ("straggler", "input_bound")}
        waiting = 1 - rank
        blamed = [f for f in findings if f.severity != "info" and f.ranks == [waiting]]
        assert not blamed, f"{case}: the waiting rank is blamed: {blamed}"
        expected = "input_bound" if phase == "data" else "straggler"
        assert set(named) == {expected}, f"{case}: {[(f.kind, f.ranks) for f in findings]}"
        finding = named[expected]
        assert finding.ranks == [rank], f"{case}: {finding.message}"
        assert finding.severity != "info" and finding.cost["fraction"] >= 0.25, f"{case}: {finding.cost}"
        assert finding.evidence["slow_phase"] == phase and f"slow {'phase: ' if phase == 'data' else 'in '}{phase}" in (
            finding.message
        ), f"{case}: {finding.message}"
