"""Recommendations are legal overrides of this project's config, differ from what ran, and A/B correctly."""

from __future__ import annotations

import functools
import shlex
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from diagnostics.analysis import Finding
from diagnostics.analysis.context import RunContext, hydra_value
from diagnostics.analysis.finding import cost
from diagnostics.diagnosis import analyse
from diagnostics.kinds.input_bound import share_hidden_by_workers
from diagnostics.kinds.needs import gated
from diagnostics.recommend import ab_tests, recommend, recommend_all
from disttrain.config.levers import catalogue_record
from disttrain.config.parse import parse_run_config
from disttrain.config.validate import BatchPlan
from disttrain.strategies.layout import validate_run
from tests.conftest import compose_train
from tests.diag_fixtures import SCENARIOS, write_run


@functools.cache
def _compose(overrides: tuple[str, ...]) -> DictConfig:
    return compose_train(list(overrides))


def composed(overrides: list[str]) -> dict:
    return OmegaConf.to_container(_compose(tuple(overrides)), resolve=True)


def validate(overrides: list[str]) -> BatchPlan:
    """Compose + parse + validate exactly as ``python -m train`` would before launching."""
    return validate_run(parse_run_config(_compose(tuple(overrides))))


@pytest.mark.parametrize("scenario", sorted(set(SCENARIOS) - {"healthy"}))
def test_every_override_composes_and_validates_with_the_real_config(tmp_path: Path, scenario: str) -> None:
    analysis = analyse(write_run(tmp_path / scenario, scenario))
    original = list(SCENARIOS[scenario].overrides)
    assert analysis.findings
    ctx = RunContext.from_run(analysis.run)
    for finding, recs in zip(analysis.findings, recommend_all(analysis), strict=True):
        assert recs, f"{finding.kind} has no recommendation"
        for rec in recs:
            if not rec.override:
                assert rec.why.startswith("No config lever"), rec
                continue
            validate([*original, *rec.override.split()])
            known, current = ctx.current(rec.key)
            assert known and hydra_value(current) != rec.value, f"{rec.override} does not change anything"


def test_no_lever_findings_say_so(tmp_path: Path) -> None:
    for scenario, kind in (("straggler", "straggler"), ("throttled", "throttling"), ("hang", "hang")):
        analysis = analyse(write_run(tmp_path / scenario, scenario))
        recs = dict(zip([f.kind for f in analysis.findings], recommend_all(analysis), strict=True))[kind]
        assert [r.override for r in recs] == [""]
        assert recs[0].why.startswith("No config lever")
    straggler = recommend_all(analyse(tmp_path / "straggler"))[0][0]
    assert "rank 2 on host node0" in straggler.why


def _ctx(**config: dict) -> RunContext:
    base = {"data": {"name": "synthetic", "num_workers": 0, "pin_memory": False}, "hw": {"accelerator": "gpu"}}
    base["hw"]["devices_per_node"] = 2
    base.update(config)
    return RunContext(base, {"global_batch_size": 32, "micro_batch_size": 16, "data_parallel_size": 2}, 16)


def _input_bound() -> Finding:
    return Finding("input_bound", "critical", [0], {"data_wait_fraction": {0: 0.4}}, "slow data")


def test_num_workers_grows_from_the_current_value() -> None:
    recs = recommend(_input_bound(), _ctx())
    assert [r.override for r in recs] == ["data.num_workers=8", "data.pin_memory=true"]  # 16 cores / 2 ranks
    grown = recommend(_input_bound(), _ctx(data={"name": "synthetic", "num_workers": 8, "pin_memory": True}))
    assert [r.override for r in grown] == ["data.num_workers=16"]


@pytest.mark.parametrize(
    ("load_s", "rest_s", "current", "workers"),
    [(0.3, 0.03, 0, 2), (0.3, 0.03, 0, 8), (0.05, 0.2, 0, 2), (0.6, 0.05, 2, 4), (0.12, 0.1, 1, 2), (1.0, 0.5, 4, 8)],
)
def test_workers_are_expected_to_hide_what_a_pipelined_loader_would(
    load_s: float, rest_s: float, current: int, workers: int
) -> None:
    """The expected saving is the step a loader of ``workers`` processes gives: a batch every load/workers, overlapped
    with the rest of the step; from in-process loading (serial) or from ``current`` workers (one batch per step)."""

    def step(n: int) -> float:
        return load_s + rest_s if n == 0 else max(rest_s, load_s / n)

    before, after = step(current), step(workers)
    wait = 1 - rest_s / before
    saved = share_hidden_by_workers(wait, current, workers) * wait
    assert saved == pytest.approx(1 - after / before)


def test_the_workers_expected_gain_is_the_share_they_hide_not_the_whole_wait() -> None:
    """A 0.3 s loader that waits (its thread idle) under a 0.03 s step, 2 ranks x 1 thread on 2 cores
    (benchmarks/tune_accuracy.py's input-bound case, measured x2.19 with 2 workers): two workers per rank are
    expected to save ~55% of the step (+120% tokens/s), not the whole 91% wait (+1000%)."""
    wait = 0.3 / 0.33
    evidence = {"data_wait_fraction": {0: wait}, "data_cpu_share": {0: 0.02}}
    finding = Finding("input_bound", "critical", [0], evidence, "slow data", cost={"fraction": wait, "basis": "wait"})
    config = {"data": {"name": "synthetic", "num_workers": 0}, "hw": {"accelerator": "cpu", "devices_per_node": 2}}
    (rec, *_) = recommend(finding, RunContext(config, {}, cpu_count=2, num_threads=1, ranks_per_host=2))
    assert rec.override == "data.num_workers=2"
    assert rec.expected_gain["fraction"] == pytest.approx(1 - 0.15 / 0.33, abs=1e-4)
    assert "2 workers per rank keep up" in rec.expected_gain["basis"]


def test_custom_datamodule_gets_the_worker_count_as_a_new_key() -> None:
    ctx = _ctx(data={"name": "custom", "_target_": "my.DataModule"})
    recs = recommend(_input_bound(), ctx)
    assert recs[0].override == "+data.num_workers=8" and "constructor" in recs[0].why
    assert recs[-1].override == "" and "datamodule" in recs[-1].why


def test_smaller_micro_batch_keeps_the_global_batch(tmp_path: Path) -> None:
    analysis = analyse(write_run(tmp_path / "m", "memory_pressure"))
    overrides = [r.override for r in recommend_all(analysis)[0]]
    assert overrides[:2] == ["trainer.global_batch_size=32 trainer.micro_batch_size=8", "strategy=fsdp"]
    fsdp = analyse(write_run(tmp_path / "f", "memory_pressure_fsdp"))
    assert recommend_all(fsdp)[0][0].override == "strategy.activation_checkpointing=true"


def ab_text(run_dir: Path, top_k: int = 3) -> str:
    analysis = analyse(run_dir)
    return "\n".join(t.shell() for t in ab_tests(analysis, recommend_all(analysis), top_k))


def test_ab_multirun_sweeps_original_against_recommended(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "ib", "input_bound")
    text = ab_text(run_dir, top_k=3)
    commands = [line for line in text.splitlines() if not line.startswith("#")]
    assert commands == [
        f"python -m train -m data.num_workers=0,2 hydra.sweep.dir={run_dir.resolve()}/ab/data.num_workers"
    ]
    assert "job 0 = original (data.num_workers=0)" in text


def test_ab_arms_are_the_original_overrides_and_the_recommended_change(tmp_path: Path) -> None:
    run_dir = write_run(
        tmp_path / "o",
        "memory_pressure",
        overrides=(*SCENARIOS["memory_pressure"].overrides, "strategy.bucket_cap_mb=50", "hydra.run.dir=x"),
    )
    analysis = analyse(run_dir)
    tests = ab_tests(analysis, recommend_all(analysis), top_k=3)
    base = [*SCENARIOS["memory_pressure"].overrides, "strategy.bucket_cap_mb=50"]
    assert all(list(t.original) == base for t in tests)  # the run as it ran, minus its Hydra settings
    micro, swap = tests[0], next(t for t in tests if t.key == "strategy")
    assert micro.override == "trainer.global_batch_size=32 trainer.micro_batch_size=8"
    assert micro.recommended == (*base, "trainer.global_batch_size=32", "trainer.micro_batch_size=8")
    assert swap.recommended == (*SCENARIOS["memory_pressure"].overrides, "strategy=fsdp")
    validate(list(swap.recommended))  # composes and validates: a legal run


def _arms(argv: tuple[str, ...]) -> list[list[str]]:
    """The two override lists a ``-m key=a,b`` sweep expands to (Hydra settings dropped: compose ignores them)."""
    args = [a for a in argv if a != "-m" and not a.startswith("hydra.")]
    key, values = args[-1].split("=", 1)
    return [[*args[:-1], f"{key}={v}"] for v in values.split(",")]


@pytest.mark.parametrize("scenario", ["memory_pressure", "comm_bound", "low_mfu", "memory_pressure_fsdp"])
def test_both_arms_of_every_ab_test_are_valid_runs(tmp_path: Path, scenario: str) -> None:
    analysis = analyse(write_run(tmp_path / scenario, scenario))
    tests = ab_tests(analysis, recommend_all(analysis), top_k=3)
    assert tests and len({t.key for t in tests}) == len(tests)
    for test in tests:
        line = test.shell().splitlines()[1]
        assert line.startswith("python -m train -m ") and shlex.split(line)[3:] == list(test.argv)
        original, recommended = _arms(test.argv)
        validate(recommended)
        # Arm A is the original run: the same config up to pinned values that restate it (same batch plan).
        base = list(SCENARIOS[scenario].overrides)
        pinned = [a for a in original if a not in base]
        assert composed(original) == composed([*base, *pinned])
        assert validate(original) == validate(base)


def test_ab_replaces_original_overrides_of_the_swept_key(tmp_path: Path) -> None:
    run_dir = write_run(
        tmp_path / "o",
        "memory_pressure",
        overrides=(*SCENARIOS["memory_pressure"].overrides, "strategy.bucket_cap_mb=50"),
    )
    analysis = analyse(run_dir)
    tests = {t.key: t for t in ab_tests(analysis, recommend_all(analysis), top_k=3)}
    swap = tests["strategy"]
    assert "strategy=ddp,fsdp" in swap.argv and "strategy.bucket_cap_mb=50" not in swap.argv
    assert "replaces strategy.bucket_cap_mb=50" in swap.note
    validate(_arms(swap.argv)[1])


def test_without_run_json_the_analysed_run_is_the_baseline(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "bare", "input_bound", manifest=False)
    text = ab_text(run_dir)
    assert "original value unknown" in text
    assert "python -m train -m data.num_workers=2 " in text


def test_hydra_values() -> None:
    assert [hydra_value(v) for v in (True, None, 8, "bf16-mixed")] == ["true", "null", "8", "bf16-mixed"]
    assert hydra_value("a b,c") == "'a b,c'"


def test_ab_keeps_the_plus_of_a_key_the_original_added(tmp_path: Path) -> None:
    # A custom datamodule's num_workers exists only because the original command added it with "+".
    run_dir = write_run(tmp_path / "c", "input_bound", config_patch={"data": {"num_workers": 1}})
    (run_dir / ".hydra" / "overrides.yaml").write_text("- +data.num_workers=1\n")
    (test,) = ab_tests(analyse(run_dir), recommend_all(analyse(run_dir)), top_k=1)
    assert "+data.num_workers=1,2" in test.argv and "+data.num_workers=1" not in test.argv


def _comm_bound() -> Finding:
    return Finding("comm_bound", "critical", [0, 1], {}, "exposed all-reduce")


def _ddp_ctx(overrides: list[str]) -> RunContext:
    """The context a real run.json would give: the composed config of ``overrides``."""
    batch = validate(overrides)
    return RunContext(composed(overrides), {"global_batch_size": batch.global_batch_size}, 2)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], ["strategy.comm_hook=bf16", "strategy.comm_hook=powersgd"]),
        (["precision=bf16-true"], ["strategy.comm_hook=powersgd"]),
        (["strategy.comm_hook=bf16"], ["strategy.comm_hook=powersgd"]),
        (["strategy.comm_hook=powersgd"], ["strategy.powersgd_rank=2"]),
        (["strategy.comm_hook=powersgd", "strategy.powersgd_rank=1"], []),
        (["model.d_model=32", "model.n_heads=2"], ["strategy.comm_hook=bf16"]),  # too narrow to compress well
        (["trainer.max_steps=30", "optimizer.warmup_steps=5"],
         ["strategy.comm_hook=bf16", "strategy.powersgd_warmup_steps=3 strategy.comm_hook=powersgd"]),
    ],
)  # fmt: skip
def test_comm_bound_ddp_gets_comm_hook_levers(overrides: list[str], expected: list[str]) -> None:
    recs = recommend(_comm_bound(), _ddp_ctx(overrides))
    hooks = [r.override for r in recs if "comm_hook" in r.override or "powersgd" in r.override]
    assert hooks == expected
    # They rank before the bucket size (fewer bytes beats fewer calls when bandwidth is the limit), and each one
    # is a legal change of this run.
    positions = [i for i, r in enumerate(recs) if r.override in hooks]
    assert [r.key for r in recs].index("strategy.bucket_cap_mb") > max(positions, default=-1)
    for rec in recs:
        if rec.override in hooks:
            validate([*overrides, *rec.override.split()])


@pytest.mark.parametrize(
    ("overrides", "offered"),
    [
        ([], True),
        (["precision=bf16-true"], True),
        (["strategy.comm_hook=powersgd"], False),  # 1-bit Adam replaces the hook, it does not add to it
        (["optimizer=onebit_adam"], False),  # already there
    ],
)
def test_comm_bound_ddp_with_adamw_is_offered_one_bit_adam(overrides: list[str], offered: bool) -> None:
    recs = recommend(_comm_bound(), _ddp_ctx(overrides))
    onebit = [r for r in recs if r.override == "optimizer=onebit_adam"]
    assert bool(onebit) is offered
    if offered:
        validate([*overrides, "optimizer=onebit_adam"])
        assert "40 MB/s" in onebit[0].expected_gain["basis"]
    # One data-parallel rank has no gradient traffic: the lever is explained, not made.
    one = RunContext(composed(overrides), {"global_batch_size": 16, "data_parallel_size": 1}, 2)
    assert "optimizer=onebit_adam" not in [r.override for r in gated(recommend(_comm_bound(), one), one, _comm_bound())]


def test_a_one_bit_adam_run_is_offered_only_what_it_can_take() -> None:
    # Hooks and other strategies are refused beside optimizer=onebit_adam, and DDP's buckets carry only its
    # warm-up: what remains is the bigger global batch, and the reason nothing else is offered.
    overrides = ["optimizer=onebit_adam"]
    ctx = _ddp_ctx(overrides)
    recs = recommend(_comm_bound(), ctx)
    made = [r.override for r in recs if r.override]
    assert made and all(o.startswith("trainer.global_batch_size=") for o in made), made
    assert any(r.why.startswith("No config lever: 1-bit Adam already sends") for r in recs)
    for override in made:
        validate([*overrides, *override.split()])


def test_powersgd_why_gives_the_compression_of_the_model_matrices() -> None:
    ctx = _ddp_ctx(["model.d_model=256", "model.n_heads=4"])
    (powersgd,) = [r for r in recommend(_comm_bound(), ctx) if r.value == "powersgd"]
    assert "a 256x256 gradient becomes (rows + cols) x 4 values, 32x fewer" in powersgd.why


def test_pipeline_bubble_on_megatron_gets_more_microbatches_then_interleaving(tmp_path: Path) -> None:
    analysis = analyse(write_run(tmp_path / "bubble", "bubble_megatron"))
    finding = next(f for f in analysis.findings if f.kind == "pipeline_bubble")
    overrides = [r.override for r in recommend(finding, RunContext.from_run(analysis.run))]
    # Same global batch (8 x 1 x 2 = 16) in 4 micro-batches of 4; then two chunks per rank; then a bigger batch.
    assert overrides[0] == "trainer.micro_batch_size=4 trainer.global_batch_size=16 strategy.microbatches=4"
    assert overrides[1] == "strategy.virtual_stages=2 strategy.schedule=interleaved_1f1b"
    assert overrides[2] == "trainer.global_batch_size=32"
    # Twice the micro-batches: the measured bubble scaled by the schedule's (pp-1)/(m+pp-1) at m=4 over m=2.
    pp, m = 2, 2
    shrink = 1 - ((pp - 1) / (2 * m + pp - 1)) / ((pp - 1) / (m + pp - 1))
    gains = [r.expected_gain["fraction"] for r in recommend(finding, RunContext.from_run(analysis.run))]
    assert gains[0] == pytest.approx(finding.cost_fraction * shrink, abs=1e-4) and gains[0] > 0


def test_no_overlap_lever_on_a_cpu_host_whose_cores_the_compute_already_fills(tmp_path: Path) -> None:
    """The README default run: 2 ranks x 1 thread on 2 cores. Smaller buckets would start the all-reduce earlier
    but on no free core; sending fewer bytes is the lever left."""
    free = analyse(write_run(tmp_path / "free", "low_overlap", cpu_count=16))
    busy = analyse(write_run(tmp_path / "busy", "low_overlap", cpu_count=2))
    (free_recs,) = recommend_all(free)
    (busy_recs,) = recommend_all(busy)
    assert [r.override for r in free_recs] == ["strategy.bucket_cap_mb=6"]
    assert free_recs[0].expected_gain["fraction"] == free.findings[0].cost["fraction"]
    assert not any("bucket_cap_mb" in r.override for r in busy_recs)
    assert [r.override for r in busy_recs][:2] == ["strategy.comm_hook=bf16", "strategy.comm_hook=powersgd"]
    assert busy_recs[0].expected_gain["fraction"] == pytest.approx(busy.findings[0].cost["fraction"] / 2, abs=1e-4)
    assert busy_recs[-1].override == "" and "occupy all 2 cores" in busy_recs[-1].why
    assert busy.findings[0].evidence["host_cores_busy"] is True
    assert "nothing to overlap with" in busy.findings[0].message


def test_every_recommendation_states_its_expected_gain(tmp_path: Path) -> None:
    for scenario in sorted(set(SCENARIOS) - {"healthy"}):
        analysis = analyse(write_run(tmp_path / scenario, scenario))
        for finding, recs in zip(analysis.findings, recommend_all(analysis), strict=True):
            for rec in recs:
                gain = rec.to_json()["expected_gain"]
                assert set(gain) == {"fraction", "basis"} and gain["basis"], (scenario, rec)
                assert 0.0 <= gain["fraction"] <= max(finding.cost["fraction"], 1.0 if finding.kind == "hang" else 0)


def test_straggler_advice_names_the_slow_phase(tmp_path: Path) -> None:
    analysis = analyse(write_run(tmp_path / "s", "healthy", slow_rank=1, slow_phase="optimizer", slow_s=0.06))
    (rec,) = recommend_all(analysis)[0]
    assert "rank 1 on host node0 is slow in optimizer" in rec.why and "optimizer step" in rec.why
    assert rec.expected_gain["fraction"] == analysis.findings[0].cost["fraction"]


@pytest.mark.parametrize(("tp", "kept"), [(2, 1.0), (4, 1 - (1 / 2) / (3 / 4))])
def test_comm_bound_without_data_parallelism_moves_activations_and_offers_half_the_tp(tp: int, kept: float) -> None:
    """strategy=megatron with dp=1 reduces no gradients between ranks: a bigger global batch (accumulation) repeats
    the same activation all-reduces every micro-batch and saves none of them. Halving tp cuts their bytes (all of
    them at tp=2); it launches with the global batch kept. Measured on moe-micro tp=2 on 2 CPU ranks: expected +105%,
    `python -m diagnose RUN --ab --run --top-k 1 --repeats 4` confirmed +73.8% (95% CI +57.5% .. +91.8%)."""
    overrides = ["strategy=megatron", f"strategy.tp={tp}", f"hw.devices_per_node={tp}", "trainer.micro_batch_size=8"]
    overrides += ["model.n_heads=4"]  # whole heads per rank at tp=4
    batch = validate(overrides)
    assert batch.data_parallel_size == 1
    ctx = RunContext(composed(overrides), {"global_batch_size": 8, "data_parallel_size": 1}, 2)
    finding = Finding("comm_bound", "critical", list(range(tp)), {}, "exposed activations", cost=cost(0.5, "test"))
    recs = recommend(finding, ctx)
    assert [r.key for r in recs] == ["strategy.tp"]
    (rec,) = recs
    assert rec.value == str(tp // 2) and rec.expected_gain["fraction"] == pytest.approx(0.5 * kept, abs=1e-4)
    assert rec.pinned == ("trainer.micro_batch_size=4", "trainer.global_batch_size=8")
    validate([*overrides, *rec.override.split()])  # the same world and global batch, launchable
    # With data parallelism and no split of the traffic (no prediction): the gradients' levers stay.
    dp_ctx = RunContext(composed(overrides), {"global_batch_size": 16, "data_parallel_size": 2}, 2)
    assert [r.key for r in recommend(finding, dp_ctx)] == ["trainer.global_batch_size"]
    # With the planner's split (tp x dp, pp=1: tp's all-reduces half the traffic, FSDP's per-micro-batch gathers
    # most of the rest, 6% once per step): half the tp, worth tp's share; accumulation would save 3%, not offered.
    split = {"once_per_step": 0.06, "tensor_parallel": 0.5, "basis": "the planner"}
    mixed = Finding("comm_bound", "critical", list(range(tp)), {"comm_split": split}, "x", cost=cost(0.5, "test"))
    (rec,) = recommend(mixed, dp_ctx)
    assert rec.key == "strategy.tp" and rec.expected_gain["fraction"] == pytest.approx(0.5 * 0.5 * kept, abs=1e-4)
    assert "50% of the communication" in rec.why and "gradients move once per step" in rec.why
    # On a host whose cores the compute fills, exposed tensor-parallel communication below comm_bound's line is
    # low_overlap: no overlap lever, but fewer bytes still shorten it: the same half-the-tp lever.
    busy = {"host_cores_busy": True, "comm_split": {"once_per_step": 0.0, "tensor_parallel": 1.0}}
    overlap = Finding("low_overlap", "warning", list(range(tp)), busy, "x", cost=cost(0.23, "test"))
    recs = recommend(overlap, ctx)
    assert recs[0].key == "strategy.tp" and recs[0].expected_gain["fraction"] == pytest.approx(0.23 * kept, abs=1e-4)
    assert recs[-1].key is None  # and why overlap cannot help here


def test_a_lever_the_recording_trainer_does_not_list_is_explained_not_made() -> None:
    """run.json's lever catalogue is the trainer's word on which overrides it takes: a report of a run dir whose
    trainer lists levers never recommends one it lacks; a run dir recorded before the catalogue is not checked."""
    overrides = ["strategy=ddp"]
    batch = {"global_batch_size": 16, "data_parallel_size": 2}
    unchecked = RunContext(composed(overrides), batch, 2)
    made = [r.override for r in gated(recommend(_comm_bound(), unchecked), unchecked, _comm_bound())]
    assert "optimizer=onebit_adam" in made
    every = frozenset(r["key"] for r in catalogue_record())
    listed = RunContext(composed(overrides), batch, 2, lever_keys=every)
    assert [r.override for r in gated(recommend(_comm_bound(), listed), listed, _comm_bound())] == made
    older = RunContext(composed(overrides), batch, 2, lever_keys=every - {"optimizer"})
    recs = gated(recommend(_comm_bound(), older), older, _comm_bound())
    assert "optimizer=onebit_adam" not in [r.override for r in recs]
    (told,) = [r for r in recs if r.key is None and "optimizer=onebit_adam is not offered" in r.why]
    assert "run.json levers" in told.why
