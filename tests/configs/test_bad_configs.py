"""Each class of invalid input gives one message naming the key and the fix, before anything is spawned."""

from __future__ import annotations

from pathlib import Path

import pytest

from disttrain.config.errors import ConfigError
from disttrain.config.parse import parse_run_config
from disttrain.job.preflight import preflight
from disttrain.job.prepare import check_machine_can_serve
from disttrain.strategies.layout import validate_run
from tests.conftest import CONF, REPO, TINY_MODEL, compose_train, run_cli

# (overrides, the key the error must name, a fragment of the fix it must give)
BAD = [
    (["trainer.global_batch_size=40"], "trainer.global_batch_size", "multiple of 32"),
    (["trainer.micro_batch_size=0"], "trainer.micro_batch_size", "> 0"),
    (["optimizer.lr=-0.001"], "optimizer.lr", "> 0"),
    (["optimizer.beta2=1.5"], "optimizer.beta2", "0.95"),
    (["optimizer.warmup_steps=500"], "optimizer.warmup_steps", "< 220"),
    (["trainer.max_steps=abc"], "trainer.max_steps", "int"),
    (["+model.n_layer=3"], "model.n_layer", "valid keys"),
    (["model.n_heads=5"], "model.n_heads", "divides d_model"),
    (["model.n_kv_heads=4"], "model.n_kv_heads", "divisor of n_heads"),
    (["model.norm=batchnorm"], "model.norm", "layernorm"),
    (["model.vocab_size=8"], "model.vocab_size", ">=16"),
    (["data.concentration=0"], "data.concentration", "> 0"),
    (["data.order=6"], "data.order", "lower data.order"),
    (["data=text"], "data.path", "data.path="),
    (["data=text", "data.path=/nonexistent/corpus.txt"], "data.path", "existing file"),
    (["data=tokens", "data.train_path=/nonexistent/train.bin"], "data.train_path", "existing file"),
    (["precision=fp16-mixed"], "precision", "bf16-mixed"),
    (["strategy=fsdp", "strategy.cpu_offload=true"], "strategy.cpu_offload", "cpu_offload=false"),
    (["strategy=fsdp", "strategy.reduce_dtype=int8"], "strategy.reduce_dtype", "fp32"),
    (["strategy=fsdp", "strategy.dp_replicate=3"], "strategy.dp_replicate", "use one of [1, 2]"),
    (["+hw.peak_tflops.fp33=1.0"], "hw.peak_tflops.fp33", "fp32"),
    (["hw.num_nodes=0"], "hw.num_nodes", "hw.num_nodes=1"),
    (["logger=wandb", "logger.mode=sometimes"], "logger.mode", "offline"),
    (["dry_run=maybe"], "dry_run", "dry_run=true"),
    (["check_memory=perhaps"], "check_memory", "check_memory=false"),
    # A key added at the top (a misspelt group or setting) would otherwise ride through the run doing nothing.
    (["+diagnostic.calibrate=false"], "diagnostic", "the groups are model, data"),
    (["+resum=outputs/x"], "resum", "the settings dry_run, resume"),
]


def test_a_misspelt_group_added_at_the_top_is_refused_with_the_group_it_meant() -> None:
    with pytest.raises(ConfigError) as info:
        parse_run_config(compose_train(["+diagnostic.calibrate=false"]))
    assert "(did you mean 'diagnostics'?)" in info.value.problem


@pytest.mark.parametrize(("overrides", "key", "fix"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_config_names_key_and_fix(overrides: list[str], key: str, fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate_run(parse_run_config(compose_train(overrides)))
    assert info.value.key == key
    assert fix in info.value.fix, info.value.fix


def test_empty_data_file_is_rejected(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ConfigError, match="is empty") as info:
        validate_run(parse_run_config(compose_train(["data=text", f"data.path={empty}"])))
    assert info.value.key == "data.path"


def test_gpu_profile_needs_gpus_unless_dry_run() -> None:
    run_cfg = parse_run_config(compose_train(["hw=8xa100", "trainer.micro_batch_size=1"]))
    with pytest.raises(ConfigError, match="needs 8 CUDA device") as info:
        check_machine_can_serve(run_cfg.hw, cuda_device_count=0)
    assert "dry_run=true" in info.value.fix
    check_machine_can_serve(run_cfg.hw, cuda_device_count=8)


def test_multi_node_profile_needs_a_cluster_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)
    run_cfg = parse_run_config(compose_train(["hw=2x8xh100"]))
    with pytest.raises(ConfigError, match="spans 2 nodes") as info:
        check_machine_can_serve(run_cfg.hw, cuda_device_count=8)
    assert info.value.key == "hw.num_nodes"


def test_cli_reports_user_error_in_one_line_with_exit_code_2(tmp_path: Path) -> None:
    result = run_cli(["trainer.micro_batch_size=-3", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("disttrain: config error")]
    assert errors == ["disttrain: config error: trainer.micro_batch_size: must be > 0, got -3. Fix: set "
                      "trainer.micro_batch_size to a value > 0"]  # fmt: skip


def test_cli_refuses_checkpoints_the_disk_cannot_hold_before_training(tmp_path: Path) -> None:
    """The default model's checkpoints (~22 MiB each, every step of 10^8 kept) against the free space under the run
    dir: one line naming trainer.keep_last_n with a value that fits, exit 2, no checkpoint started."""
    run_dir = tmp_path / "run"
    result = run_cli(["trainer.max_steps=100000000", "trainer.ckpt_every_n_steps=1", f"hydra.run.dir={run_dir}"],
                     cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("disttrain: config error")]
    assert error.startswith("disttrain: config error: trainer.keep_last_n: 100000000 checkpoints of 20.9 MiB each")
    assert "Fix: set trainer.keep_last_n=" in error and f"free at '{run_dir}'" in error
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "run.json").exists()


def test_cli_refuses_gpu_profile_on_this_machine_at_once(tmp_path: Path) -> None:
    result = run_cli(["hw=8xa100", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 2
    assert "hw=8xa100 needs 8 CUDA device(s) per node but this machine has 0" in result.stderr
    assert not (tmp_path / "run" / "run.json").exists()


def test_cli_dry_run_of_a_cluster_config_prints_the_launch(tmp_path: Path) -> None:
    args = ["strategy=fsdp", "hw=8xa100", "model=llama-7b", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}"]
    result = run_cli(args, cwd=REPO)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "1 node(s) x 8 GPU (a100-sxm4-80gb) = world size 8" in out
    assert "fsdp (reshard_after_forward=True" in out
    assert "6,738,415,616 parameters" in out
    assert "global 128 = micro 16 x dp 8 x accumulation 1" in out
    assert "precision    fp32" in out
    # The planner's prediction is printed; micro batch 16 x 4096 tokens of llama-7b cannot fit an A100.
    assert "memory       predicted" in out and "EXCEEDS 72.0 GiB usable" in out
    assert "warning: a real launch would be refused" in out
    assert "dry run: configuration is valid; nothing was launched" in out


def test_default_warmup_is_shortened_to_fit_a_short_run_and_said() -> None:
    from disttrain.job.prepare import prepare

    prepared = prepare(compose_train(["trainer.max_steps=10"]), None, ["trainer.max_steps=10"])
    assert prepared.run_cfg.optimizer.warmup_steps == 1
    assert prepared.warmup_note is not None and "optimizer.warmup_steps" in prepared.warmup_note
    assert "\n" not in prepared.warmup_note
    default = compose_train([])
    long_enough = prepare(default, None, [])
    assert long_enough.warmup_note is None
    assert long_enough.run_cfg.optimizer.warmup_steps == default.optimizer.warmup_steps
    # 1-bit Adam's default freeze (100 steps) moves to a fifth of a run it does not fit, in the same line.
    onebit = ["optimizer=onebit_adam", "trainer.max_steps=60"]
    fitted = prepare(compose_train(onebit), None, onebit)
    assert (fitted.run_cfg.optimizer.warmup_steps, fitted.run_cfg.optimizer.freeze_steps) == (30, 12)
    assert fitted.warmup_note is not None and "\n" not in fitted.warmup_note
    assert "optimizer.freeze_steps: the default 100 does not fit trainer.max_steps=60; using 12" in fitted.warmup_note
    # A warmup set on the command line is the user's: one that does not fit stays an error.
    explicit = ["trainer.max_steps=10", "optimizer.warmup_steps=30"]
    with pytest.raises(ConfigError) as caught:
        prepare(compose_train(explicit), None, explicit)
    assert caught.value.key == "optimizer.warmup_steps"


def test_a_sweeps_later_job_is_refused_by_its_number_and_swept_values_only() -> None:
    with pytest.raises(ConfigError) as info:
        preflight(
            ["-m", "strategy=ddp,fsdp", "trainer.micro_batch_size=16,5", "trainer.global_batch_size=32", *TINY_MODEL],
            CONF,
        )
    assert info.value.key == "trainer.global_batch_size"
    assert info.value.problem.endswith("(in sweep job #1: strategy=ddp trainer.micro_batch_size=5)")
    preflight(["-m", "strategy=ddp,fsdp", "trainer.micro_batch_size=16,8", *TINY_MODEL], CONF)  # all four fine
