"""Three Lightning projects written as plain Lightning code (tests/lightning_projects), plugged in with
``~model +model._target_=... ~data +data._target_=...``: each trains under ddp, fsdp and deepspeed stage 2 on 2 gloo
ranks, learns, and matches one process to 1e-4 in fp32; their reports speak samples/s and MFU from counted FLOPs.

The projects log their losses with ``sync_dist=True`` (the mean over ranks, which with equal per-rank batches is the
global batch's), and their loaders do not shuffle: Lightning's DistributedSampler then hands rank r the samples
r, r+2, ..., so 2 ranks of micro-batch m see, step by step, exactly the samples one process of 2m sees.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from diagnostics.telemetry import telemetry_path
from tests.conftest import REPO, load_checkpoint, read_manifest, run_cli

pytestmark = pytest.mark.dist

STEPS = 20
PROJECTS = "tests.lightning_projects"
COMMON = [
    f"trainer.max_steps={STEPS}",
    "trainer.log_every_n_steps=1",
    "trainer.val_every_n_steps=10",
    "trainer.val_batches=2",
    "trainer.ckpt_every_n_steps=0",
    "precision=fp32",
]
# project: (its overrides, the loss it logs per step, the metric it validates with, the micro-batch of 2 ranks)
MODULES = {
    "classifier": (
        [f"+model._target_={PROJECTS}.classifier.LitClassifier", f"+model.net._target_={PROJECTS}.classifier.ConvNet",
         f"+data._target_={PROJECTS}.classifier.DigitsData"],
        "train_loss", "val_loss", 8,
    ),
    "recommender": (
        [f"+model._target_={PROJECTS}.recommender.LitRecommender", f"+data._target_={PROJECTS}.recommender.RatingsData",
         "+model.lr=0.05", "+data.active=64"],
        "train_mse", "val_mse", 64,
    ),
    # Accumulation: 2 micro-batches a step on 2 ranks, 4 in one process.
    "regressor": (
        [f"+model._target_={PROJECTS}.regressor.LitRegressor", f"+data._target_={PROJECTS}.regressor.WaveData",
         "trainer.global_batch_size=64"],
        "train_loss", "val_loss", 16,
    ),
}  # fmt: skip
LAYOUTS = {
    "ddp": ["strategy=ddp"],
    "fsdp": ["strategy=fsdp"],
    "deepspeed-2": ["strategy=deepspeed", "strategy.stage=2"],
}
# Mixed precision is not bitwise: these learn beside the fp32 reference (FSDP2 casts, DDP and DeepSpeed autocast).
BF16 = {"fsdp-bf16": ["strategy=fsdp", "precision=bf16-mixed"], "ddp-bf16": ["strategy=ddp", "precision=bf16-mixed"]}
COMPILED = {"fsdp-compile": ["strategy=fsdp", "+model.compile=true"]}
DIAGNOSED = {
    ("classifier", "ddp"), ("recommender", "fsdp"), ("regressor", "deepspeed-2"), ("regressor", "fsdp-compile"),
}  # fmt: skip


def logged(run_dir: Path, name: str) -> dict[int, float]:
    """``name`` by step as the CSV logger wrote it (metrics/metrics.csv)."""
    with (run_dir / "metrics" / "metrics.csv").open() as handle:
        return {int(row["step"]): float(row[name]) for row in csv.DictReader(handle) if row.get(name)}


class ModuleRuns:
    """Each (project, layout) run once per module; ``single`` is the one-process reference of a project."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.done: dict[tuple[str, str], tuple[Path, str]] = {}

    def get(self, project: str, layout: str) -> tuple[Path, str]:
        if (project, layout) not in self.done:
            overrides, _, _, micro = MODULES[project]
            if layout == "single":
                shape = ["hw.devices_per_node=1", f"trainer.micro_batch_size={2 * micro}"]
            else:
                shape = [*{**LAYOUTS, **BF16, **COMPILED}[layout], f"trainer.micro_batch_size={micro}"]
            diagnosed = [] if (project, layout) in DIAGNOSED else ["diagnostics=off"]
            run_dir = self.factory.mktemp(f"{project}-{layout}") / "run"
            args = ["~model", "~data", *overrides, *COMMON, *diagnosed, *shape, f"hydra.run.dir={run_dir}"]
            result = run_cli(args, cwd=REPO)
            console = result.stdout + result.stderr
            assert result.returncode == 0, console[-4000:]
            self.done[(project, layout)] = (run_dir, console)
        return self.done[(project, layout)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> ModuleRuns:
    return ModuleRuns(tmp_path_factory)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("project", sorted(MODULES))
def test_two_ranks_match_one_process_and_learn(project: str, layout: str, runs: ModuleRuns) -> None:
    _, loss_name, val_name, _ = MODULES[project]
    reference_dir, _ = runs.get(project, "single")
    run_dir, _ = runs.get(project, layout)
    # The module's own loss, and train/loss (the returned loss over the step's micro-batches and ranks, step_loss.py)
    for name in (loss_name, "train/loss"):
        reference, losses = logged(reference_dir, name), logged(run_dir, name)
        assert sorted(losses) == sorted(reference) and len(losses) >= STEPS - 1
        worst = max(abs(losses[s] - reference[s]) for s in reference)
        assert worst <= 1e-4 * max(1.0, abs(reference[min(reference)])), f"max |{name} - one process| = {worst:.2e}"
    reference = logged(reference_dir, loss_name)
    val, val_reference = logged(run_dir, val_name), logged(reference_dir, val_name)
    assert sorted(val) == sorted(val_reference)
    assert max(abs(val[s] - val_reference[s]) for s in val) <= 1e-4 * max(1.0, abs(val_reference[min(val)]))
    first, last = reference[min(reference)], reference[max(reference)]
    assert last < 0.7 * first, f"{project} did not learn: {loss_name} {first:.4f} -> {last:.4f}"
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "completed"
    assert manifest["work"] == {
        "unit": "sample", "lightning_module": True, "automatic_optimization": True, "tokens_per_sample": None,
    }  # fmt: skip


def test_model_compile_compiles_the_users_module_under_fsdp_and_keeps_its_math(runs: ModuleRuns) -> None:
    """The regressor's MLP compiled (inductor on CPU) and sharded, with accumulation: the same losses as one eager
    process, and its FLOPs still counted (on the second micro-batch, flop_count.py). Not the conv classifier: this
    torch's CPU inductor computes its conv/max-pool backward wrong at 8 rows (eager and aot_eager agree; RESULTS.md)."""
    reference_dir, _ = runs.get("regressor", "single")
    run_dir, console = runs.get("regressor", "fsdp-compile")
    assert "torch.compile" in console
    for name in ("train_loss", "train/loss"):
        reference, losses = logged(reference_dir, name), logged(run_dir, name)
        assert sorted(losses) == sorted(reference)
        worst = max(abs(losses[s] - reference[s]) for s in reference)
        assert worst <= 1e-4 * max(1.0, abs(reference[min(reference)])), f"max |{name} - one process| = {worst:.2e}"
    assert read_manifest(run_dir)["status"] == "completed"
    eager_dir, _ = runs.get("regressor", "deepspeed-2")
    flops = [json.loads((d / "report" / "report.json").read_text())["summary"]["flops_per_sample"]
             for d in (run_dir, eager_dir)]  # fmt: skip
    assert flops[0] == pytest.approx(flops[1])  # counted on the compiled run's second micro-batch, as eager's first


@pytest.mark.parametrize(("project", "layout"), sorted(DIAGNOSED))
def test_reports_speak_samples_and_counted_flops(project: str, layout: str, runs: ModuleRuns) -> None:
    run_dir, console = runs.get(project, layout)
    summary = json.loads((run_dir / "report" / "report.json").read_text())["summary"]
    assert summary["work_unit"] == "sample" and summary["samples_per_s"] > 0
    assert "tokens_per_s" not in summary and "flops_per_token" not in summary
    result = read_manifest(run_dir)["result"]
    assert result["samples_per_s"] == pytest.approx(summary["samples_per_s"], rel=0.02)
    assert result["tokens_per_s"] is None
    assert "samples/s" in console and "tokens/s" not in console and "tok/s" not in console
    assert "(nats/token)" not in console  # a module's own metrics, by the names it logged them under
    assert f"{MODULES[project][2]} " in console.split("done:")[-1]
    if project == "recommender":  # embedding lookups and elementwise work: no matmul to count
        assert summary.get("flops_per_sample") is None and summary["calibrated_mfu"] is None
    else:
        assert summary["flops_per_sample"] > 0 and 0 < summary["calibrated_mfu"] < 1
    # The split of the step: every rank's communication measured beside its compute.
    shares = summary["step_shares"]
    assert shares["compute"] > 0 and shares["communication"] > 0
    # The planner's prediction from the module measured on meta at launch (job/run.py), beside the measurement: the
    # training state (parameters, gradients, the module's own optimizer's states) of this layout's rank 0.
    prediction = read_manifest(run_dir)["prediction"]
    assert abs(prediction["error"]["state_bytes"]) <= 0.10, prediction
    if project == "recommender":  # no compute counted: no step time is predicted from communication alone
        assert "step_time_s" not in prediction["predicted"] and "no FLOPs were counted" in prediction["unpredicted"]
    else:
        assert prediction["predicted"]["step_time_s"] > 0 and "step_time_s" in prediction["error"]
    # Under DDP every rank holds the module whole: each times it on a copy after training (training/module_probe.py)
    # and the step is composed from those parts; sharded layouts keep the FLOPs-based step.
    probed = layout == "ddp"
    for rank in (0, 1):
        records = [json.loads(line) for line in telemetry_path(run_dir, rank).read_text().splitlines()]
        timed = [r for r in records if r["kind"] == "parts_calibration"]
        assert len(timed) == int(probed) and all(r["whole_module"] for r in timed)
    assert (prediction["basis"]["edges_forward_backward"] == "measured") == probed, prediction["basis"]


@pytest.mark.parametrize("layout", sorted(BF16))
def test_the_regressor_learns_in_bf16_mixed_with_accumulation(layout: str, runs: ModuleRuns) -> None:
    """The bf16 MLP regressor with 2 micro-batches a step on 2 ranks: its loss follows the fp32 one-process run's
    (bf16 keeps 8 bits of mantissa: within 5%) and falls as far."""
    reference = logged(runs.get("regressor", "single")[0], "train_loss")
    run_dir, console = runs.get("regressor", layout)
    losses = logged(run_dir, "train_loss")
    assert sorted(losses) == sorted(reference)
    assert max(abs(losses[s] - reference[s]) / reference[s] for s in reference) < 0.05
    assert losses[max(losses)] < 0.7 * losses[min(losses)]
    assert "precision    bf16-mixed" in console and "accumulation 2" in console


SHUFFLED = [*MODULES["classifier"][0], "+data.shuffle=true", "trainer.max_steps=20", "trainer.ckpt_every_n_steps=10",
            "trainer.micro_batch_size=8", "diagnostics=off", "precision=fp32"]  # fmt: skip


def module_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_checkpoint(checkpoint)["state_dict"].items() if isinstance(v, torch.Tensor)}


def test_a_lightning_module_resumes_exactly_across_layouts_and_exports_into_its_own_class(tmp_path: Path) -> None:
    """A shuffled classifier's step-10 checkpoint resumed under its own layout ends bitwise where the uninterrupted
    run ended (the loader continues mid-epoch, not from its first batch); under deepspeed and in one process it
    ends within float rounding; the export loads into the user's own class with ``load_from_checkpoint``."""
    from tests.lightning_projects.classifier import ConvNet, LitClassifier

    def train(name: str, args: list[str]) -> Path:
        run_dir = tmp_path / name
        result = run_cli([*args, f"hydra.run.dir={run_dir}"], cwd=REPO)
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        return run_dir

    whole = train("whole", ["~model", "~data", *SHUFFLED])
    final = module_weights(whole / "checkpoints" / "step000020.ckpt")
    mid = whole / "checkpoints" / "step000010.ckpt"
    for name, extra, tolerance in (
        ("same", [], 0.0),
        ("deepspeed", ["strategy=deepspeed"], 1e-6),
        ("one-process", ["hw.devices_per_node=1", "trainer.micro_batch_size=16"], 1e-6),
    ):
        resumed = module_weights(train(name, [f"resume={mid}", *extra]) / "checkpoints" / "step000020.ckpt")
        assert resumed.keys() == final.keys()
        worst = max((resumed[k] - final[k]).abs().max().item() for k in final)
        assert worst <= tolerance, f"{name}: max |w - uninterrupted| = {worst:.2e}"
    result = run_cli([f"export={tmp_path / 'deepspeed'}"], cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    exported = tmp_path / "deepspeed" / "export" / "step000020.ckpt"
    module = LitClassifier.load_from_checkpoint(exported, net=ConvNet(), weights_only=True)
    assert module.hparams.lr == 0.05 and module.hparams.step_size == 20
    weights = module_weights(tmp_path / "deepspeed" / "checkpoints" / "step000020.ckpt")
    assert all(torch.equal(module.state_dict()[k], weights[k]) for k in weights)
    plain = torch.load(exported.with_suffix(".pt"), weights_only=True)
    LitClassifier(ConvNet()).load_state_dict(plain)  # the module's own names, strict


def test_an_optuna_sweep_maximizes_a_metric_the_module_logs(tmp_path: Path) -> None:
    """``objective=val_acc``: maximized (its name measures a gain), each trial's value its final logged val_acc."""
    import optuna

    sweep = tmp_path / "sweep"
    trial = ["hw.devices_per_node=1", "trainer.max_steps=10", "trainer.val_every_n_steps=5", "trainer.val_batches=2",
             "trainer.ckpt_every_n_steps=0", "diagnostics=off"]  # fmt: skip
    args = ["-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=grid", "hydra.sweeper.n_jobs=1", "~model", "~data",
            *MODULES["classifier"][0], "+model.lr=choice(0.0005,0.05)", "objective=val_acc", *trial,
            f"hydra.sweep.dir={sweep}"]  # fmt: skip
    result = run_cli(args, cwd=REPO)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    study = optuna.load_study(study_name="disttrain", storage=f"sqlite:///{sweep / 'optuna.db'}")
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE
    done = study.get_trials()
    assert len(done) == 2 and all(t.state == optuna.trial.TrialState.COMPLETE for t in done)
    for t in done:
        assert t.value == read_manifest(sweep / t.user_attrs["disttrain.job"])["result"]["metrics"]["val_acc"]
    assert study.best_trial.params["+model.lr"] == 0.05 and study.best_value > min(t.value for t in done)
    report = json.loads((sweep / "report" / "sweep.json").read_text())
    assert all(r["unit"] == "sample" and r["tokens_per_s"] > 0 and r["val_loss"] is not None for r in report["runs"])


def test_a_slow_rank_inside_a_users_module_is_named_with_its_phase(tmp_path: Path) -> None:
    """Rank 1 sleeps 50 ms in its forward; the module logs with sync_dist=True, a reduce inside training_step where
    rank 0 waits for rank 1. Timed as the collective it is, the wait is rank 0's and the slowness rank 1's forward
    (untimed, both ranks' forward read 57 ms and no straggler was found)."""
    run_dir = tmp_path / "run"
    args = ["~model", "~data", "+model._target_=tests.plugins.SleepyRankClassifier",
            f"+model.net._target_={PROJECTS}.classifier.ConvNet", f"+data._target_={PROJECTS}.classifier.DigitsData",
            "trainer.max_steps=30", "trainer.val_every_n_steps=30", "trainer.ckpt_every_n_steps=0",
            f"hydra.run.dir={run_dir}"]  # fmt: skip
    result = run_cli(args, cwd=REPO)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    report = json.loads((run_dir / "report" / "report.json").read_text())
    stragglers = [f for f in report["findings"] if f["kind"] == "straggler"]
    assert len(stragglers) == 1 and stragglers[0]["ranks"] == [1], [f["message"] for f in report["findings"]]
    assert "slow in forward" in stragglers[0]["message"]
    assert report["findings"][0]["kind"] == "straggler"  # the costliest
    assert report["summary"]["step_shares"]["waiting"] > 0.2  # rank 0's wait, not communication
