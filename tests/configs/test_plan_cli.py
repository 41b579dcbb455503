"""``python -m plan``: JSON and table output of the real CLI, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from disttrain.config.errors import USER_ERROR_EXIT_CODE, ConfigError
from disttrain.planner import JSON_KEYS
from disttrain.planner.spec import parse_parameter_count
from pipelines.plan import measured_tokens_per_s, plan_from_config
from tests.conftest import CONF


def run_plan(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(
        [sys.executable, "-m", "plan", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def compose_plan(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="plan", overrides=overrides)


def test_json_output_lists_every_candidate_with_the_issue_keys(tmp_path: Path) -> None:
    args = ["model=llama-70b", "hw=2x8xh100", "trainer.micro_batch_size=1"]
    result = run_plan([*args, "output=json"], tmp_path)
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert (payload["model"], payload["hw"], payload["world_size"]) == ("llama-70b", "2x8xh100", 16)
    assert payload["num_parameters"] == 68_976_648_192
    candidates = payload["candidates"]
    assert len(candidates) == len(plan_from_config(compose_plan(args)).candidates)
    assert all(tuple(c) == JSON_KEYS for c in candidates)
    recommended = payload["recommended"]
    assert candidates[0]["fits"] and candidates[0]["strategy"] == recommended["strategy"]
    assert candidates[0]["options"] == recommended["options"]
    assert recommended["overrides"][0] == f"strategy={recommended['strategy']}"
    assert list(tmp_path.iterdir()) == []  # planning writes no output directory or log


def test_table_output_recommends_first_with_its_train_command(tmp_path: Path) -> None:
    args = ["model=llama-7b", "hw=8xa100", "trainer.micro_batch_size=1", "throughput.tokens_per_s=20000"]
    result = run_plan(args, tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    best = plan_from_config(compose_plan(args)).recommended
    assert best is not None
    assert "llama-7b on 8xa100" in out and "MFU" in out and "fits" in out
    assert f"recommended: {best.label} (fastest predicted step among" in out
    command = "python -m train model=llama-7b hw=8xa100 precision=bf16-mixed trainer.micro_batch_size=1 "
    assert command + " ".join(best.overrides) in out
    assert "measured 20,000 tokens/s on 8 x a100-sxm4-80gb means MFU" in out
    rows = [line for line in out.splitlines() if line.startswith("│  1 │")]
    assert rows and best.label in rows[0]


def test_raw_parameter_count(tmp_path: Path) -> None:
    result = run_plan(["num_parameters=7.5B", "hw=2x8xh100", "output=json", "throughput.tokens_per_s=1e5"], tmp_path)
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["num_parameters"] == 7_500_000_000 and payload["activations_known"] is False
    assert all(c["memory_bytes"]["activations"] == 0 for c in payload["candidates"])
    assert payload["throughput"]["mfu"] == pytest.approx(1e5 * 6 * 7.5e9 / (16 * 989.4e12))


# (overrides, the key the error names)
BAD = [
    (["output=xml"], "output"),
    (["hw=cpu"], "hw.peak_tflops"),
    (["num_parameters=lots"], "num_parameters"),
    (["num_parameters=-3"], "num_parameters"),
    (["headroom=1.5"], "headroom"),
    (["limit=0"], "limit"),
    (["trainer.global_batch_size=7"], "trainer.global_batch_size"),
    (["model.n_heads=5"], "model.n_heads"),
    (["+assumptions.speedup=2"], "assumptions.speedup"),
    (["assumptions.compute_efficiency=0"], "assumptions.compute_efficiency"),
    (["assumptions.comm_overlap=1.5"], "assumptions.comm_overlap"),
    (["throughput.tokens_per_s=-1"], "throughput.tokens_per_s"),
    (["sequence_parallel=maybe"], "sequence_parallel"),
    (["model.head_dim=0"], "model.head_dim"),
    (["model.head_dim=64", "num_parameters=7B"], "model.head_dim"),
]


@pytest.mark.parametrize(("overrides", "key"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_names_the_key(overrides: list[str], key: str) -> None:
    cfg = compose_plan(overrides)
    with pytest.raises(ConfigError) as info:
        plan_from_config(cfg)
        measured_tokens_per_s(cfg)
    assert info.value.key == key


def test_bad_input_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    result = run_plan(["hw=cpu"], tmp_path)
    assert result.returncode == USER_ERROR_EXIT_CODE
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("disttrain: config error: hw.peak_tflops:")
    assert "hw=8xa100" in result.stderr


@pytest.mark.parametrize(
    ("args", "start"),
    [
        (["hw=8xa10"], "hw: unknown option '8xa10' (did you mean '8xa100'?)"),
        (["model.n_layer=3"], "model.n_layer: is not a setting of model (did you mean 'n_layers'?)"),
        (["trainer=fast"], "trainer: unknown option 'fast'"),
        # added with +: Hydra composes any key, and the train command the plan prints would be refused for it
        (
            ["+diagnostic.calibrate=false"],
            "diagnostic: is not a setting of plan or train (did you mean 'diagnostics'?)",
        ),
    ],
)
def test_a_wrong_group_option_or_key_is_one_line_as_in_train(args: list[str], start: str, tmp_path: Path) -> None:
    result = run_plan(args, tmp_path)
    assert result.returncode == USER_ERROR_EXIT_CODE, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(f"disttrain: config error: {start}")


@pytest.mark.parametrize(
    ("value", "count"),
    [("7.5B", 7_500_000_000), (7.5e9, 7_500_000_000), ("70b", 70 * 10**9), ("1T", 10**12), (125, 125)],
)
def test_parameter_counts_read_with_suffixes(value: object, count: int) -> None:
    assert parse_parameter_count(value) == count


# PaLM 540B (Chowdhery et al. 2022, Table 1 and sec. 2): 118 layers, d_model 18432, 48 heads of width 256 (not
# 18432 / 48), multi-query attention, SwiGLU 4 x d_model, shared input/output embedding of a 256k vocabulary.
PALM = ["model=llama-7b", "model.n_layers=118", "model.d_model=18432", "model.n_heads=48", "model.n_kv_heads=1",
        "model.head_dim=256", "model.ffn_hidden=73728", "model.vocab_size=256000", "model.tie_embeddings=true",
        "model.seq_len=2048", "hw=8xa100", "hw.num_nodes=64", "trainer.micro_batch_size=1"]  # fmt: skip


def test_head_dim_other_than_d_model_over_heads_plans_palm_540b() -> None:
    from disttrain.planner import layer_activation_bytes

    result = plan_from_config(compose_plan(PALM))
    shape = result.shape
    # The paper prints 540.35B; the reference block has two norms where PaLM's parallel block has one (+2.2M).
    assert 540.35e9 <= shape.num_parameters < 540.36e9, shape.num_parameters
    assert (shape.head_dim, shape.kv_heads) == (256, 1)
    wide = plan_from_config(compose_plan([o for o in PALM if not o.startswith("model.head_dim")])).shape
    assert wide.head_dim == 384  # what d_model / n_heads alone gives
    tokens = 2048
    # q and the attention output are 48 x 256 wide (k, v one head each): the saved activations follow.
    less = layer_activation_bytes(wide, 1, tokens) - layer_activation_bytes(shape, 1, tokens)
    assert less == 2 * 2 * tokens * 48 * (384 - 256) + 2 * 2 * tokens * (384 - 256)


def test_head_dim_plan_prints_strategy_overrides_not_a_train_command(tmp_path: Path) -> None:
    result = run_plan([*PALM, "limit=3"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "strategy overrides: strategy=" in result.stdout and "python -m train" not in result.stdout


@pytest.mark.parametrize(("value", "allowed"), [("true", {True}), ("false", {False}), ("null", {True, False})])
def test_sequence_parallel_can_be_left_off_tensor_parallelism(value: str, allowed: set[bool]) -> None:
    result = plan_from_config(compose_plan(["model=llama-7b", f"sequence_parallel={value}"]))
    tensor_parallel = [c.layout for c in result.candidates if c.strategy == "megatron" and c.layout.tp > 1]
    assert tensor_parallel and {layout.sequence_parallel for layout in tensor_parallel} == allowed


def test_json_has_host_memory_and_the_table_names_the_overridden_node_count(tmp_path: Path) -> None:
    args = ["model=llama-7b", "hw=8xa100", "hw.num_nodes=4", "trainer.micro_batch_size=1"]
    result = run_plan([*args, "output=json"], tmp_path)
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert (payload["hw"], payload["world_size"]) == ("4x8xa100", 32)
    offloaded = [c for c in payload["candidates"] if c["options"].get("offload_optimizer")]
    assert offloaded and all(c["memory_bytes"]["host"] > 0 for c in offloaded)
    table = run_plan([*args, "limit=1"], tmp_path)
    assert "llama-7b on 4x8xa100" in table.stdout and "on 8xa100" not in table.stdout


def test_calibration_from_a_run_dir_replaces_the_datasheet_numbers(tmp_path: Path) -> None:
    from tests.unit.test_calibration import write_calibration_run

    run = tmp_path / "run"
    write_calibration_run(run)
    args = ["hw=cpu", "precision=fp32", f"calibration={run}", "output=json"]
    result = run_plan(args, tmp_path)
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["hw_sources"] == {
        "peak_tflops": "measured",
        "hbm_bandwidth_gbps": "measured",
        "intra_node_bandwidth_gbps": "measured",
        "inter_node_bandwidth_gbps": "none",
        "intra_node_latency_us": "measured",
        "inter_node_latency_us": "none",
        "collective_busbw_gbps": "measured",
        "collective_latency_us": "measured",
        "sync_overhead_us": "measured",
        "compute_jitter": "measured",
        "comm_overlap": "measured",
        "tp_linear_overhead_us": "measured",
        "tp_edge_overhead_us": "none",  # a pair probe's record: no edges measured
        "tp_step_overhead_us": "none",  # nor the step's tail
        "fsdp_unit_overhead_us": "none",  # the calibration records hold no FSDP probe
        "fsdp_copy_ns_per_byte": "none",
        "fsdp_step_tensor_us": "none",
        "fsdp_step_fixed_us": "none",
        "zero_backward_fixed_us": "none",  # nor a ZeRO probe
        "zero_backward_ns_per_byte": "none",
        "zero_step_fixed_us": "none",
        "zero_step_ns_per_byte": "none",
        "loop_overhead_us": "none",  # nor step records
    }
    assert payload["recommended"] is not None  # hw=cpu has no datasheet peak: only the calibration times steps
    table = run_plan(args[:-1], tmp_path)
    assert "hw numbers: peak_tflops measured, hbm_bandwidth_gbps measured, intra_node_bandwidth_gbps measured" in (
        table.stdout
    )
    on_a_gpu = run_plan([f"calibration={run}"], tmp_path)  # the default hw: 8 A100s, planned from a CPU run
    assert on_a_gpu.returncode == USER_ERROR_EXIT_CODE
    assert on_a_gpu.stderr.strip().splitlines() == [
        f"disttrain: config error: calibration: '{run}' was measured on cpu, and hw=8xa100 is a gpu profile. "
        "Fix: pass a run on a gpu machine, or hw= the profile of the machine that run used"
    ]
    missing = run_plan(["calibration=/nonexistent/run"], tmp_path)
    assert missing.returncode == USER_ERROR_EXIT_CODE
    assert missing.stderr.strip().startswith("disttrain: config error: calibration: '/nonexistent/run' is neither")


BIG_RECOMMENDER = [
    "~model",
    "+model._target_=tests.lightning_projects.recommender.LitRecommender",
    "+model.num_users=100000000",
    "+model.num_items=100000000",
    "~data",
    "+data._target_=tests.lightning_projects.recommender.RatingsData",
]


def test_a_lightning_module_too_big_for_ddp_is_planned_sharded() -> None:
    """Measured on meta (nothing allocated): 13.0B parameters, Adam's two moments, bf16-mixed on 8 x A100-80GB."""
    result = plan_from_config(compose_plan(BIG_RECOMMENDER))
    n = result.shape.num_parameters
    assert n == 2 * 100_000_000 * 65 and result.shape.unit == "sample" and result.shape.optimizer_states == 2.0
    ddp = next(c for c in result.candidates if c.strategy == "ddp")
    assert not ddp.fits and (ddp.memory.params, ddp.memory.grads, ddp.memory.optimizer_states) == (4 * n, 4 * n, 8 * n)
    best = result.recommended
    assert best is not None and best.strategy in ("fsdp", "deepspeed") and best.fits
    assert best.memory.params + best.memory.grads + best.memory.optimizer_states < (4 + 4 + 8) * n / 4
    assert {c.strategy for c in result.candidates} == {"ddp", "fsdp", "deepspeed"}  # no TP/PP plan for a module


def test_the_plan_of_a_lightning_module_prints_a_train_command_train_accepts(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    result = run_plan(BIG_RECOMMENDER, repo)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "samples/s" in result.stdout and "micro-batch 16 samples, global batch 128 samples" in result.stdout
    assert "note: no matmul or convolution FLOPs counted: compute time is not predicted (0)" in result.stdout
    command = next(line.strip() for line in result.stdout.splitlines() if line.strip().startswith("python -m train "))
    assert all(override in command.split() for override in BIG_RECOMMENDER)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    dry = subprocess.run(
        [sys.executable, "-m", "train", *command.split()[3:], "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "dry run: configuration is valid; nothing was launched" in dry.stdout
    assert "memory       predicted " in dry.stdout and "fits in 72.0 GiB usable" in dry.stdout
    # The same module under DDP: the launch's memory check (the module measured on meta) would refuse it.
    ddp = subprocess.run(
        [sys.executable, "-m", "train", *BIG_RECOMMENDER, "hw=8xa100", "strategy=ddp", "dry_run=true",
         f"hydra.run.dir={tmp_path / 'ddp'}"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    refused = next(line for line in ddp.stdout.splitlines() if line.startswith("warning: a real launch would be"))
    assert "predicted 242.1 GiB per GPU with strategy=ddp exceeds the 72.0 GiB usable on hw=8xa100" in refused
    assert "python -m plan" in refused and "(or strategy=auto)" in refused
    # strategy=auto sizes the module the same way: DDP does not fit, a sharded layout is chosen, said why.
    auto = subprocess.run(
        [sys.executable, "-m", "train", *BIG_RECOMMENDER, "hw=8xa100", "strategy=auto", "dry_run=true",
         f"hydra.run.dir={tmp_path / 'auto'}"],
        cwd=repo, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert auto.returncode == 0, auto.stderr[-2000:]
    chose = next(line for line in auto.stdout.splitlines() if line.startswith("strategy=auto chose "))
    assert chose.startswith(("strategy=auto chose FSDP2", "strategy=auto chose ZeRO")), chose
    assert "ddp/fsdp/deepspeed layouts that fit" in chose and "your module measured on meta" in chose
    assert "warning: a real launch would be refused" not in auto.stdout


CLASSIFIER = [
    "~model",
    "+model._target_=tests.lightning_projects.classifier.LitClassifier",
    "+model.net._target_=tests.lightning_projects.classifier.ConvNet",
    "~data",
    "+data._target_=tests.lightning_projects.classifier.DigitsData",
    "hw=cpu",
    "precision=fp32",
]


@pytest.mark.parametrize(("micro", "basis", "scale"), [(64, "measured", 1.0), (128, "scaled", 2.0)])
def test_a_run_that_timed_the_module_gives_the_plan_its_compute(
    micro: int, basis: str, scale: float, tmp_path: Path
) -> None:
    """``calibration=RUN_DIR`` of a run that timed this module whole (training/module_probe.py): every layout's
    compute is its forward and backward, at another micro-batch scaled by samples."""
    from diagnostics.telemetry import TelemetryWriter
    from tests.unit.test_calibration import write_calibration_run

    run = tmp_path / "run"
    write_calibration_run(run)
    for rank in (0, 1):
        writer = TelemetryWriter(run, rank)
        writer.write(
            "parts_calibration", micro_batch=64, seq_len=1, d_model=0, vocab_size=0, block_numel=7018,
            block_forward_s=0.0, block_backward_s=0.0, edges_forward_s=0.002, edges_backward_s=0.003,
            optimizer_step_s=0.0004, precision="fp32", whole_module=True,
        )  # fmt: skip
        writer.close()
    result = plan_from_config(compose_plan([*CLASSIFIER, f"trainer.micro_batch_size={micro}", f"calibration={run}"]))
    assert result.shape.num_parameters == 7018  # the module the run timed
    ddp = next(c for c in result.candidates if c.strategy == "ddp")
    assert ddp.estimate.compute_basis == basis
    assert ddp.estimate.compute_s == pytest.approx(0.005 * scale)
