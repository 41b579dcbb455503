"""On a GPU the host's clocks time kernel launches, not kernels: host overhead is the device's idle time.

Seen on an H200 (benchmarks/gpu_suite.py): llama-1b kept the GPU busy 97% of the profiled step, yet the host waited
~70% of each step at the per-step sync after queuing its kernels, and the report called that `critical
host_overhead 69%`. And a GPU held at its own rated power limit (sw_power_cap, default limit) is not a fault.
"""

from __future__ import annotations

import pytest

from diagnostics.diagnosis import analyse
from tests.diag_fixtures import GPU, write_run

GPU_RUN = (*GPU, "precision=bf16-mixed")


def findings(tmp_path, **changes):
    return {f.kind: f for f in analyse(write_run(tmp_path / "run", "healthy", **changes)).findings}


def test_host_waiting_for_a_busy_gpu_is_not_host_overhead(tmp_path):
    # 0.4 s a step outside the host-timed phases (the host blocked on queued kernels), the device never idle.
    analysis = analyse(write_run(tmp_path / "run", "healthy", overrides=GPU_RUN, other=0.4))
    assert "host_overhead" not in {f.kind for f in analysis.findings}
    assert analysis.summary.step_shares["host"] < 0.05


def test_an_idle_gpu_between_launches_is_host_overhead_costed_by_its_idle_share(tmp_path):
    # 0.25 s a step with no kernel running on a ~0.57 s step: the profile's device idle share is the cost.
    # A run's manifest records model.compile as decided (on, for a GPU under DDP).
    compiled = (*GPU_RUN, "model.compile=true")
    analysis = analyse(write_run(tmp_path / "run", "healthy", overrides=compiled, host_gap=0.25))
    host = {f.kind: f for f in analysis.findings}["host_overhead"]
    idle = 0.25 / (0.25 + 0.10 + 0.20 + 0.02 + 0.02 + 0.001 + 0.0005)
    assert host.cost_fraction == pytest.approx(idle, abs=0.08)
    assert analysis.summary.step_shares["host"] == pytest.approx(host.cost_fraction, abs=0.05)
    # Already compiled (model.compile decided on for a GPU): the levers left are more work per launch and, under
    # DDP on two GPUs (where CUDA graphs are not the default), replaying each block's kernels as a graph.
    overrides = [r.override for r in host_recommendations(analysis)]
    assert any(o.startswith("trainer.micro_batch_size") for o in overrides)
    assert "model.compile_mode=reduce-overhead" in overrides


def test_cuda_graphs_are_not_offered_again_nor_where_the_config_refuses_them(tmp_path):
    for extra in (("model.compile_mode=reduce-overhead",), ("strategy=fsdp",), ("model=hf-tiny-llama",)):
        overrides = (*GPU_RUN, "model.compile=true", *extra)
        run = write_run(tmp_path / "-".join(extra), "healthy", overrides=overrides, host_gap=0.25)
        overrides = [r.override for r in host_recommendations(analyse(run))]
        assert not [o for o in overrides if o.startswith("model.compile_mode")], extra


def host_recommendations(analysis):
    from diagnostics.recommend import recommend_all

    by_kind = dict(zip([f.kind for f in analysis.findings], recommend_all(analysis), strict=True))
    return by_kind["host_overhead"]


def test_on_cpu_the_time_outside_every_phase_is_still_host_overhead(tmp_path):
    assert "host_overhead" in findings(tmp_path, other=0.4)


@pytest.mark.parametrize(
    ("limits", "normal"),
    [((700.0, 700.0), True), ((500.0, 700.0), False), (None, False)],
    ids=["rated-limit", "lowered-limit", "limits-unknown"],
)
def test_power_cap_at_the_rated_limit_is_the_normal_state_of_a_loaded_gpu(tmp_path, limits, normal):
    found = findings(
        tmp_path, overrides=GPU_RUN, throttle_rank=1, throttle_reasons=("sw_power_cap",), power_limits_w=limits
    )
    # A lowered limit (or unknown limits) slows the job against what the board can do: a warning or worse.
    assert (found["throttling"].severity == "info") == normal
    assert ("rated power limit" in found["throttling"].message) == normal


def test_thermal_slowdown_stays_a_warning_whatever_the_power_limit(tmp_path):
    found = findings(tmp_path, overrides=GPU_RUN, throttle_rank=1, power_limits_w=(700.0, 700.0))
    assert found["throttling"].severity in ("warning", "critical")


def test_an_idle_start_up_does_not_make_a_busy_run_host_bound(tmp_path):
    """NVML samples from compile and start-up (the GPU idle for a minute before the first step) are not the steps'."""
    import json

    run_dir = write_run(tmp_path / "run", "healthy", overrides=GPU_RUN)
    for path in sorted((run_dir / "telemetry").glob("rank*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        first = min(r["t"] for r in records if r["kind"] == "sample")
        rank = records[0]["rank"]
        idle = [
            {"kind": "sample", "rank": rank, "t": first - 60 + i, "source": "nvml", "device_index": rank, "util_pct": 0}
            for i in range(50)
        ]
        path.write_text("".join(json.dumps(r) + "\n" for r in [records[0], *idle, *records[1:]]))
    assert "host_overhead" not in {f.kind for f in analyse(run_dir).findings}


@pytest.mark.parametrize(("outside", "first"), [(0.105, "trainer.micro_batch_size=8"), (0.0, "model.compile=true")])
def test_overhead_outside_the_phases_is_amortized_first_inside_them_compiled_first(outside: float, first: str) -> None:
    """Time outside every timed phase is the step loop's own Python (hooks, logging, the optimizer call): compile
    cannot touch it, more tokens per step amortize it (a 2-layer 32-wide model on 2 CPU ranks, 10.5% outside:
    micro-batch 8 +75% tokens/s, compile -2.9%, 3 interleaved rounds). Gaps inside forward/backward: compile."""
    from diagnostics.analysis import Finding
    from diagnostics.analysis.context import RunContext
    from diagnostics.analysis.finding import cost
    from diagnostics.recommend import recommend

    evidence = {
        "unattributed_fraction": {0: outside, 1: outside},
        "profile_unexplained_idle_fraction": {0: 0.12, 1: 0.12},
        "threshold_fraction": 0.1,
    }
    finding = Finding("host_overhead", "warning", [0, 1], evidence, "overhead", cost=cost(0.12, "test"))
    ctx = RunContext({"model": {"compile": False}, "trainer": {"micro_batch_size": 4}}, {"accumulation": 1}, 2)
    overrides = [r.override for r in recommend(finding, ctx)]
    assert overrides[0] == first and {"model.compile=true", "trainer.micro_batch_size=8"} <= set(overrides)
