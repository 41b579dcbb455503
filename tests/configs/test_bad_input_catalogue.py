"""The bad-input catalogue: every entry is one mistake a user makes on the command line.

Each must end with exit code 2 and exactly one line ``disttrain: config error: <key>: ... Fix: ...`` naming the
key and the fix, no traceback, and nothing created anywhere or changed in an existing run dir. The entries run
through ``pipelines/train.py``'s entry point in this process (Hydra's own errors included: the preflight turns
them into our message before Hydra starts); one runs as a real subprocess to pin the process exit code.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch

from disttrain.config.parse import parse_run_config
from disttrain.models.factory import build_model_factory
from tests.conftest import TINY_MODEL, compose_train, run_cli

SMALL = TINY_MODEL

# (overrides with {placeholders} for the fixture's files, extra environment, key named, fragment of the fix)
CATALOGUE: list[tuple[list[str], dict[str, str], str, str]] = [
    # Hydra-level: unknown group option, unknown key, unparsable override, a sweep without -m
    (["model=gpt-nan"], {}, "model", "model=gpt-nano"),
    (["strategy=zero3"], {}, "strategy", "conf/strategy/"),
    (["experiment=does-not-exist"], {}, "experiment", "conf/experiment/"),
    (["trainer.max_step=5"], {}, "trainer.max_step", "'max_steps'"),
    (["dryrun=true"], {}, "dryrun", "'dry_run'"),
    (["+diagnostic.calibrate=false"], {}, "diagnostic", "the groups are"),  # added with +: Hydra takes any key
    (["trainer.max_steps=[1,"], {}, "trainer.max_steps", "key=value"),
    (["optimizer.lr=1e-3,3e-3"], {}, "optimizer.lr", "add -m"),
    # wrong types
    (["trainer.max_steps=abc"], {}, "trainer.max_steps", "int"),
    (["dry_run=maybe"], {}, "dry_run", "dry_run=true"),
    # out-of-range values
    (["trainer.micro_batch_size=0"], {}, "trainer.micro_batch_size", "> 0"),
    (["optimizer.beta2=1.5"], {}, "optimizer.beta2", "0.95"),
    (["trainer.global_batch_size=40"], {}, "trainer.global_batch_size", "multiple of 32"),
    (["model.n_heads=5"], {}, "model.n_heads", "divides d_model"),
    (["trainer.keep_last_n=0"], {}, "trainer.keep_last_n", "> 0"),
    (["trainer.nan_policy=explode"], {}, "trainer.nan_policy", "trainer.nan_policy=stop"),
    (["trainer.max_restarts=-1"], {}, "trainer.max_restarts", ">= 0"),
    # incompatible strategy / precision / hardware
    (["precision=fp16-mixed"], {}, "precision", "bf16-mixed"),
    (["strategy=fsdp", "strategy.cpu_offload=true"], {}, "strategy.cpu_offload", "cpu_offload=false"),
    (["hw=8xa100"], {}, "hw", "dry_run=true"),
    (["hw.devices_per_node=4"], {"WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "1"}, "hw.devices_per_node", "is 2"),
    # missing or empty data files
    (["data=text"], {}, "data.path", "data.path="),
    (["data=text", "data.path={missing}"], {}, "data.path", "existing file"),
    (["data=text", "data.path={empty_txt}"], {}, "data.path", "with data in it"),
    (["data=tokens", "data.train_path={empty_bin}", "data.vocab_size=256"], {}, "data.train_path", "with data in it"),
    # resume: missing, nothing to resume from, only a cut-off checkpoint, another model's checkpoint
    (["resume={missing}"], {}, "resume", "point resume at a run dir"),
    (["resume={no_checkpoints}"], {}, "resume", "complete checkpoint"),
    (["resume={truncated}"], {}, "resume", "complete checkpoint"),
    (["resume={existing}", "model.d_model=64"], {}, "model", "model settings the run was started with"),
    # a DDP checkpoint file from before the universal layout, under another strategy; weights-only without a resume
    (["resume={existing}", "strategy=fsdp"], {}, "strategy", "resume once with strategy=ddp"),
    (["resume_weights_only=true"], {}, "resume_weights_only", "add resume=<run dir>"),
    # a setting of the resumed run's strategy without naming that strategy again; a typo in one
    (["resume={megatron}", "strategy.tp=2"], {}, "strategy.tp", "resume=... strategy=megatron strategy.tp=2"),
    (["resume={megatron}", "strategy.tpp=2"], {}, "strategy.tpp", "'tp'"),
    # the run dir of an existing run; a file name that would lead out of the run dir
    (["hydra.run.dir={existing}"], {}, "hydra.run.dir", "hydra.run.dir=<new dir>"),
    # a run dir another launch has claimed (and not written into yet); a sweep dir that holds a sweep
    (["hydra.run.dir={claimed}"], {}, "hydra.run.dir", "hydra.run.dir=<new dir>"),
    (["-m", "optimizer.lr=1e-3,3e-3", "hydra.sweep.dir={swept}"], {}, "hydra.sweep.dir", "hydra.sweep.dir=<new dir>"),
    (["hydra.job.name=../../escaped"], {}, "hydra.job.name", "plain name"),
    # a sweep whose later job is wrong: refused before its first job trains, not when that job starts
    (["-m", "optimizer.lr=1e-3,-1"], {}, "optimizer.lr", "> 0"),
    (
        ["-m", "strategy=ddp,fsdp", "trainer.micro_batch_size=16,5", "trainer.global_batch_size=32"],
        {},
        "trainer.global_batch_size",
        "multiple of",
    ),
]


def snapshot(root: Path) -> dict[str, str]:
    """Every file and directory under ``root`` with a hash of its content: what 'nothing changed' means."""
    state = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        state[rel] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return state


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A working directory holding an existing run (with a real checkpoint) and a few bad inputs."""
    monkeypatch.chdir(tmp_path)
    existing = tmp_path / "outputs" / "existing"
    (existing / "checkpoints").mkdir(parents=True)
    (existing / ".hydra").mkdir()
    (existing / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in SMALL))
    (existing / "run.json").write_text('{"status": "completed"}\n')
    model = parse_run_config(compose_train(SMALL)).model
    weights = build_model_factory(model, 0)().state_dict()
    checkpoint = existing / "checkpoints" / "step000003.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in weights.items()}, "global_step": 3}, checkpoint)
    (existing / "checkpoints" / "last.ckpt").symlink_to("step000003.ckpt")

    megatron = tmp_path / "outputs" / "megatron"
    (megatron / ".hydra").mkdir(parents=True)
    (megatron / ".hydra" / "overrides.yaml").write_text("- strategy=megatron\n- strategy.pp=2\n")

    truncated = tmp_path / "outputs" / "truncated"
    (truncated / "checkpoints").mkdir(parents=True)
    data = checkpoint.read_bytes()
    (truncated / "checkpoints" / "step000003.ckpt").write_bytes(data[: len(data) // 2])
    no_checkpoints = tmp_path / "outputs" / "no_checkpoints"
    (no_checkpoints / ".hydra").mkdir(parents=True)
    (no_checkpoints / ".hydra" / "overrides.yaml").write_text("[]\n")
    claimed = tmp_path / "outputs" / "claimed"
    claimed.mkdir(parents=True)
    (claimed / ".claim.json").write_text('{"pid": 4321, "host": "node7", "time": 1700000000.0}\n')
    swept = tmp_path / "multirun" / "swept"
    swept.mkdir(parents=True)
    (swept / "multirun.yaml").write_text("hydra: {}\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty.bin").write_bytes(b"")
    for var in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "GROUP_RANK", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(var, raising=False)
    return {
        "root": tmp_path,
        "existing": existing,
        "megatron": megatron,
        "truncated": truncated,
        "claimed": claimed,
        "swept": swept,
        "no_checkpoints": no_checkpoints,
        "missing": tmp_path / "no" / "such" / "path",
        "empty_txt": tmp_path / "empty.txt",
        "empty_bin": tmp_path / "empty.bin",
    }


def test_catalogue_has_at_least_twenty_distinct_inputs() -> None:
    assert len({" ".join(args) for args, *_ in CATALOGUE}) == len(CATALOGUE) >= 20


@pytest.mark.parametrize(("args", "env", "key", "fix"), CATALOGUE, ids=[" ".join(c[0]) for c in CATALOGUE])
def test_bad_input_gives_one_line_naming_key_and_fix(
    args: list[str],
    env: dict[str, str],
    key: str,
    fix: str,
    world: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import train  # pipelines/train.py, installed as a top-level module

    def must_not_start(prepared: object) -> None:
        pytest.fail("the preflight let a bad command through to Hydra")

    monkeypatch.setattr(train, "hydra_app", must_not_start)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = [a.format(**{k: str(v) for k, v in world.items()}) for a in args]
    monkeypatch.setattr(sys, "argv", ["train", *argv])
    before = snapshot(world["root"])

    with pytest.raises(SystemExit) as exited:
        train.cli()

    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"disttrain: config error: {key}: "), lines[0]
    _, _, given_fix = lines[0].partition(". Fix: ")
    assert given_fix and fix in given_fix, lines[0]
    assert snapshot(world["root"]) == before  # nothing created, nothing touched


def test_hydra_level_mistake_exits_2_from_the_real_cli(tmp_path: Path) -> None:
    """What Hydra used to refuse with its own message and exit code 1."""
    result = run_cli(["model=gpt-nan", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "disttrain: config error: model: unknown option 'gpt-nan' (did you mean 'gpt-nano'?). Fix: choose one of "
        "['deepseek-moe-16b', 'gpt-micro', 'gpt-nano', 'gpt2-124m', 'gpt2-350m', 'hf', 'hf-tiny-gpt2', "
        "'hf-tiny-llama', 'hf-tiny-mixtral', 'llama-13b', 'llama-1b', 'llama-70b', 'llama-7b', 'mixtral-8x7b', "
        "'moe-micro', 'olmoe-1b-7b'] (conf/model/), "
        "e.g. model=gpt-nano"
    ]
    assert list(tmp_path.iterdir()) == []
