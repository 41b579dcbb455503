"""End-to-end ``python -m train`` runs: the default job's promise, outputs, sweeps, and every data/logger kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diagnostics.telemetry import telemetry_path
from disttrain.config.levers import catalogue_record
from tests.conftest import load_checkpoint, read_manifest, run_cli
from tests.dist.test_parity_and_resume import train_losses
from tests.logged import tensorboard_scalars, wandb_history

pytestmark = pytest.mark.dist


def run_ok(args: list[str], cwd: Path) -> str:
    return run_ok_with_stderr(args, cwd)[0]


def run_ok_with_stderr(args: list[str], cwd: Path) -> tuple[str, str]:
    result = run_cli(args, cwd=cwd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout, result.stderr


@pytest.mark.exclusive  # both cores busy for 100 s: beside another test both take twice as long (measured)
def test_default_run_reaches_the_floor_and_records_everything(tmp_path: Path) -> None:
    run_dir = tmp_path / "default"
    out, err = run_ok_with_stderr([f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    manifest = read_manifest(run_dir)
    result = manifest["result"]
    assert manifest["status"] == "completed"
    assert result["steps"] == 220
    assert result["loss_floor"] == pytest.approx(0.7624, abs=1e-4)
    # The promise: the default run ends within 0.10 nats/token of the data's entropy floor.
    assert 0.0 < manifest["result_gap_to_floor"] < 0.10, result
    assert result["tokens_per_s"] > 0
    # The run's own step timer (diagnostics off keeps it) agrees with the telemetry's median step on rank 0.
    steps = [json.loads(line) for line in telemetry_path(run_dir, 0).read_text().splitlines()]
    telemetry_p50 = sorted(r["step_s"] for r in steps if r["kind"] == "step" and r["step"] > 22)
    assert result["step_time_p50_s"] == pytest.approx(telemetry_p50[len(telemetry_p50) // 2], rel=0.1)
    assert f"median step {1e3 * result['step_time_p50_s']:.1f} ms" in out
    assert f"val gap to floor {manifest['result_gap_to_floor']:+.4f}" in out
    assert f"run dir     {run_dir}" in out
    assert "step 220/220" in out

    assert manifest["world"] == {"num_nodes": 1, "devices_per_node": 2, "world_size": 2, "data_parallel_size": 2}
    assert manifest["batch"]["global_batch_size"] == 32
    assert manifest["num_parameters"] == 1_828_992
    assert manifest["flops_per_token"] > 6 * 1_828_992 * 0.9
    assert manifest["hw"]["name"] == "cpu"
    assert {"torch", "lightning", "hydra", "python"} <= set(manifest["versions"])
    assert manifest["levers"] == catalogue_record()  # the trainer's lever catalogue, for a report off this machine
    assert manifest["wall_time_s"] > 0
    assert manifest["config"]["strategy"]["name"] == "ddp"

    assert (run_dir / "config.yaml").read_text().startswith("dry_run: false")
    assert (run_dir / ".hydra" / "overrides.yaml").exists()
    metrics = (run_dir / "metrics" / "metrics.csv").read_text()
    assert "train/loss" in metrics and "val/loss" in metrics
    # Diagnostics are on by default: a healthy run gets its report and no false alarm. Its exposed all-reduce
    # (~2% of the step) and the ranks' turns at being preempted on a shared host are info at most (it also passed
    # beside another test under xdist).
    report = json.loads((run_dir / "report" / "report.json").read_text())
    alarms = [(f["kind"], f["severity"], f["cost"]) for f in report["findings"] if f["severity"] != "info"]
    assert alarms == [], report["findings"]
    assert report["summary"]["tokens_per_s"] > 0
    for rank in (0, 1):
        records = [json.loads(line) for line in telemetry_path(run_dir, rank).read_text().splitlines()]
        calibrations = [r["flops_per_s"] for r in records if r["kind"] == "calibration"]
        assert [r["when"] for r in records if r["kind"] == "calibration"] == ["start", "end"]
        if rank == 0:  # the peak MFU is measured against: the better of the two measurements
            (throughput,) = [r for r in records if r["kind"] == "throughput"]
            assert throughput["calibrated_peak_flops"] == max(calibrations)
        (end,) = [r for r in records if r["kind"] == "end"]
        assert end["collectors_s"] > 0  # their own time, which benchmarks/diagnostics_overhead.py reports
    assert "diagnostics:" in out
    assert "profiler_start" not in out + err  # kineto's C++ "USDT:" lines stay off the console
    # Closing the loop: the start-up calibration measured each collective over the 2 ranks, and run.json, the
    # report and the console hold the planner's prediction with those speeds beside the measurement.
    links = [json.loads(line) for line in telemetry_path(run_dir, 0).read_text().splitlines()]
    links = {r["op"]: r for r in links if r["kind"] == "link_calibration"}
    assert set(links) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert all(r["link"] == "intra_node" and r["ranks"] == 2 and r["busbw_gbps"] > 0 for r in links.values())
    assert links["all_reduce"]["busbw_gbps"] == pytest.approx(links["all_reduce"]["algbw_gbps"])  # 2(n-1)/n = 1
    calibration = json.loads((run_dir / "calibration.json").read_text())
    assert calibration["links"]["intra_node"]["all_reduce"] > 0 and calibration["ranks"] == 2
    assert set(calibration["op_latency_us"]["intra_node"]) == set(links)  # each collective's own call cost
    assert calibration["compute_jitter"] is not None  # the ranks' drift, from the sync rounds at start-up
    prediction = read_manifest(run_dir)["prediction"]
    assert prediction["basis"]["peak_tflops"] == "measured" == prediction["basis"]["intra_node_bandwidth_gbps"]
    # The step is composed from the run's own parts, timed on every rank at start-up at its micro-batch (16 x 128).
    assert prediction["basis"]["block_forward_backward"] == "measured" == prediction["basis"]["optimizer_step"]
    # And the step outside its phases (its batch's data wait, the loop's hooks and logging), from its own steps.
    assert calibration["loop_overhead_us"] > 0 and prediction["basis"]["loop_overhead_us"] == "measured"
    assert prediction["predicted"]["loop_s"] == pytest.approx(calibration["loop_overhead_us"] * 1e-6)
    parts = calibration["parts"]
    assert (parts["micro_batch"], parts["seq_len"], parts["d_model"], parts["precision"]) == (16, 128, 192, "fp32")
    assert parts["block_backward_s"] > 0 and parts["edges_forward_s"] > 0 and parts["optimizer_step_s"] > 0
    # Four blocks and the edges at least: forward + backward of the whole model on one rank, per micro-batch.
    whole = 4 * (parts["block_forward_s"] + parts["block_backward_s"]) + parts["edges_forward_s"]
    assert prediction["predicted"]["compute_s"] == pytest.approx(whole + parts["edges_backward_s"])
    assert set(prediction["error"]) >= {"step_time_s", "tokens_per_s", "mfu", "comm_s", "state_bytes"}
    for key, error in prediction["error"].items():
        measured, predicted = prediction["measured"][key], prediction["predicted"][key]
        assert error == pytest.approx(predicted / measured - 1), key
    # The model states are predicted exactly: fp32 weights, gradients and two Adam moments (+ Adam's step counters).
    assert abs(prediction["error"]["state_bytes"]) < 0.01, prediction
    assert report["prediction"]["error"] == pytest.approx(prediction["error"], abs=1e-5)  # report rounds to 1e-6
    assert "planner (calibrated) predicted vs measured: step time" in out
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["last.ckpt", "step000100.ckpt", "step000200.ckpt", "step000220.ckpt"]
    assert (run_dir / "checkpoints" / "last.ckpt").resolve().name == "step000220.ckpt"


SHORT = [
    "trainer.max_steps=12",
    "trainer.log_every_n_steps=4",
    "trainer.val_every_n_steps=6",
    "trainer.val_batches=2",
    "trainer.micro_batch_size=4",
    "optimizer.warmup_steps=2",
    "data.num_train_tokens=32768",
    "data.num_val_tokens=4096",
]


@pytest.fixture(scope="module")
def text_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A finished text-file run and its command: its own test and the refused second run share it."""
    tmp = tmp_path_factory.mktemp("text")
    corpus = tmp / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 2000)
    args = [*SHORT[:-2], "data=text", f"data.path={corpus}", "logger=tensorboard", f"hydra.run.dir={tmp / 'run'}"]
    run_ok(args, tmp)
    return tmp / "run", args


# text_run is a timed run (tests/scheduling.py: TIMED_RUNS): its logged windows are compared with its rate, so the
# first of its users launches it alone.
def test_second_run_in_the_same_dir_is_refused_and_leaves_the_first_intact(text_run: tuple[Path, list[str]]) -> None:
    run_dir, args = text_run
    before = (run_dir / "run.json").read_text()
    again = run_cli(args, cwd=run_dir.parent)
    assert again.returncode == 2
    assert "already holds a run" in again.stderr
    assert (run_dir / "run.json").read_text() == before


def test_text_file_with_tensorboard_logger(text_run: tuple[Path, list[str]]) -> None:
    run_dir, _ = text_run
    result = read_manifest(run_dir)["result"]
    assert result["loss_floor"] is None  # real text has no known floor
    assert result["val_loss"] < 5.0  # below uniform over bytes (ln 256 = 5.55)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_tensorboard_gets_every_group_and_the_report(text_run: tuple[Path, list[str]]) -> None:
    """What the console and the report know is in the event file while the run goes, and the report at its end."""
    run_dir, _ = text_run
    scalars, texts = tensorboard_scalars(run_dir / "tensorboard")
    summary = json.loads((run_dir / "report" / "report.json").read_text())["summary"]
    (run_rate,) = [value for _, value in scalars["throughput/tokens_per_s_run"]]
    assert run_rate == pytest.approx(summary["tokens_per_s"], rel=0.05)
    (mfu_run,) = [value for _, value in scalars["throughput/mfu_calibrated_run"]]
    assert mfu_run == pytest.approx(summary["calibrated_mfu"], rel=1e-3, abs=1e-6)
    # Every logging step after the warm-up (12 steps, logged every 4), on the same steps as the loss.
    windows = scalars["throughput/tokens_per_s"]
    assert [step for step, _ in windows] == [step for step, _ in scalars["train/loss"]] == [3, 7, 11]
    assert all(run_rate / 3 < value < 3 * run_rate for _, value in windows)
    assert all(0 < value < 1 for _, value in scalars["throughput/mfu_calibrated"])
    for key in ("time/step_p50_s", "time/step_max_s", "memory/host_rss_gib", "optim/grad_norm"):
        assert scalars[key] and all(0 < value < 100 for _, value in scalars[key]), key
    # The ranks' gap and the communication split come with the rank gather (every 10 steps): logged at step 12.
    for key in ("ranks/step_time_gap_s", "ranks/busy_gap_s", "comm/exposed_share", "comm/waiting_share"):
        assert [step for step, _ in scalars[key]] == [11] and 0 <= scalars[key][0][1] < 1, key
    assert scalars["ranks/slowest_rank"][0][1] in (0.0, 1.0)
    (report_text,) = texts["diagnostics/report/text_summary"]
    assert report_text.startswith("# ") and "tokens/s" in report_text


def test_token_file_with_offline_wandb_logger(tmp_path: Path) -> None:
    import numpy as np

    tokens = tmp_path / "train.bin"
    (np.arange(60_000) % 97).astype(np.uint16).tofile(tokens)  # a counting sequence: very learnable
    run_dir = tmp_path / "run"
    args = [*SHORT[:-2], "data=tokens", f"data.train_path={tokens}", "data.vocab_size=97", "logger=wandb"]
    run_ok([*args, f"hydra.run.dir={run_dir}"], tmp_path)
    assert read_manifest(run_dir)["result"]["val_loss"] < 4.0  # ln 97 = 4.57
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    # The diagnostics report rides along as an artifact in the offline run (synced with `wandb sync`).
    assert b"diagnostics-report" in b"".join(p.read_bytes() for p in offline.glob("*.wandb"))
    # The same keys as every logger's, in the run's history; the run's own rate and MFU are the report's.
    history = wandb_history(offline)
    keys = {key for row in history for key in row}
    assert {"train/loss", "throughput/tokens_per_s", "throughput/mfu_calibrated", "time/step_p50_s",
            "memory/host_rss_gib", "optim/grad_norm", "ranks/busy_gap_s", "comm/exposed_share"} <= keys  # fmt: skip
    summary = json.loads((run_dir / "report" / "report.json").read_text())["summary"]
    (run_rate,) = [row["throughput/tokens_per_s_run"] for row in history if "throughput/tokens_per_s_run" in row]
    assert run_rate == pytest.approx(summary["tokens_per_s"], rel=1e-5)  # report.json keeps 6 significant digits
    (mfu_run,) = [row["throughput/mfu_calibrated_run"] for row in history if "throughput/mfu_calibrated_run" in row]
    assert mfu_run == pytest.approx(summary["calibrated_mfu"], rel=1e-3, abs=1e-6)


@pytest.mark.parametrize(
    ("overrides", "strategy", "precision"),
    [
        (["strategy=ddp", "precision=bf16-true"], "ddp", "bf16-true"),
        # The recipe is exactly strategy=fsdp + precision=bf16-mixed: one run shows it composes to them and trains.
        (["experiment=nano-fsdp-bf16"], "fsdp", "bf16-mixed"),
    ],
    ids=["ddp-bf16-true", "experiment-fsdp-bf16-mixed"],
)
def test_bf16_runs_train(overrides: list[str], strategy: str, precision: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_ok([*SHORT, *overrides, f"hydra.run.dir={run_dir}"], tmp_path)
    manifest = read_manifest(run_dir)
    assert (manifest["config"]["strategy"]["name"], manifest["config"]["precision"]["name"]) == (strategy, precision)
    assert manifest["result"]["val_loss"] < 3.5  # from ~5.5 at init (ln 256)
    if strategy == "fsdp":  # the FSDP probe timed the run's own step tail over sharded (DTensor) parameters
        calibration = json.loads((run_dir / "calibration.json").read_text())
        assert calibration["fsdp_step_tensor_us"] > 0 and calibration["fsdp_step_fixed_us"] >= 0
        assert manifest["prediction"]["basis"]["fsdp_step_tensor_us"] == "measured"


@pytest.mark.slow
def test_compile_true_trains_a_mixture_of_experts(tmp_path: Path) -> None:
    """Compiled MoE blocks: the experts' token counts are data, so the exchange and the experts run eager inside
    the compiled block. Before, step 17 of this run failed in the compiler (an expert given no tokens: shape [0, 64])
    and the report's own model.compile=true advice crashed MoE runs. The blocks of a dense model take the same path
    (models/factory.py compiles each block, whatever its feed-forward): this one launch serves both."""
    run_dir = tmp_path / "run"
    args = ["model=moe-micro", "trainer.micro_batch_size=2", "trainer.max_steps=24", "trainer.val_every_n_steps=24",
            "trainer.log_every_n_steps=1", "model.compile=true", "diagnostics=off",
            f"hydra.run.dir={run_dir}"]  # fmt: skip
    run_ok(args, tmp_path)
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(24)) and losses[23] < losses[0]
    assert read_manifest(run_dir)["config"]["model"]["compile"] is True
    # The compiled blocks' weights are saved under the one-process names, not torch.compile's wrapper's.
    names = load_checkpoint(run_dir / "checkpoints" / "step000024.ckpt")["state_dict"]
    assert "model.blocks.1.attn.wq.weight" in names and not [n for n in names if "_orig_mod" in n]
