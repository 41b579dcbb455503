"""Shared helpers: compose the real conf/ tree and run the real CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

# Two xdist workers share this machine's cores, so every process the tests start (and torch in the workers, which
# reads this at import) takes one intra-op thread: a one-rank run taking both cores beside another test's job waits
# at each op's barrier for a parked sibling thread (the suite measured 3.7-4.8 s steps of a 0.3 s step).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from disttrain.config.hardware import HardwareProfile
from disttrain.config.schema import ModelConfig
from tests.scheduling import Exclusivity, WorkerLock, auto_workers, order_files, record_timeline

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
# The reference transformer's presets (conf/model/hf*.yaml are Hugging Face models: tests/configs/test_hf_configs.py).
MODEL_PRESETS = sorted(p for p in (CONF / "model").glob("*.yaml") if "\nfamily: hf\n" not in p.read_text())
# The smallest model the multi-process tests train: 2 layers, d_model 32, 2 heads, 32 tokens.
TINY_MODEL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.ffn_hidden=64", "model.seq_len=32"]


def model_preset(name_or_path: str | Path) -> ModelConfig:
    """A ``conf/model`` preset by name (``llama-7b``) or path, as the typed ModelConfig."""
    path = Path(name_or_path) if str(name_or_path).endswith(".yaml") else CONF / "model" / f"{name_or_path}.yaml"
    return ModelConfig(**OmegaConf.to_container(OmegaConf.load(path)))


def hw_profile(name: str) -> HardwareProfile:
    """A ``conf/hw`` profile by name, as the typed HardwareProfile."""
    return HardwareProfile(**OmegaConf.to_container(OmegaConf.load(CONF / "hw" / f"{name}.yaml")))


def compose_train(overrides: list[str] | None = None) -> DictConfig:
    """``conf/train.yaml`` composed exactly as ``python -m train <overrides>`` would."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides or [])


def compose_train_each(base: list[str], variants: list[list[str]]) -> list[DictConfig]:
    """``compose_train([*base, *variant])`` for every variant, composing once per structural part: the overrides
    that choose a config group or add/delete a key. The plain ``key=value`` overrides are then applied the way
    Hydra applies them (parsed by its override grammar, ``OmegaConf.update`` under the composed config's struct
    flag, so an unknown key still fails). A full Hydra compose costs ~0.1 s: hundreds of them, half a minute."""
    parser = OverridesParser.create()
    by_structure: dict[tuple[str, ...], DictConfig] = {}
    composed = []
    for variant in variants:
        parsed = parser.parse_overrides(variant)
        structural = tuple(
            o.input_line or ""
            for o in parsed
            if o.is_add() or o.is_delete() or o.is_force_add() or (CONF / o.key_or_group).is_dir()
        )
        if structural not in by_structure:
            by_structure[structural] = compose_train([*base, *structural])
        plain = [o.input_line or "" for o in parsed if o.input_line not in structural]
        composed.append(with_plain_overrides(by_structure[structural], plain))
    return composed


def with_plain_overrides(composed: DictConfig, overrides: list[str]) -> DictConfig:
    """A copy of a composed config with plain ``key=value`` overrides applied as Hydra applies them (its grammar,
    ``OmegaConf.update`` under the struct flag: an unknown key fails): no second compose."""
    cfg = composed.copy()
    for override in OverridesParser.create().parse_overrides(overrides):
        OmegaConf.update(cfg, override.key_or_group, override.value(), merge=True)
    return cfg


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def run_cli(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m train ARGS`` in ``cwd``; torch threads and output buffering set for a 2-core CI box."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}
    env.pop("LOCAL_RANK", None)
    return subprocess.run(
        [sys.executable, "-m", "train", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def load_checkpoint(checkpoint: Path) -> dict:
    """A whole checkpoint as one dict: ``state_dict`` (model tensors by single-process name), ``optimizer_0``
    (flattened optimizer state) and the rest Lightning saved (``global_step``, ``loops``, ``rng_states``, ...)."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(checkpoint, Path(tmp) / "merged.pt")
        state = torch.load(Path(tmp) / "merged.pt", weights_only=False)
    return {**torch.load(checkpoint / "meta.pt", weights_only=True), **state}


def read_manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


@pytest.fixture
def tiny_run_args() -> list[str]:
    """A few-second run of the default stack: small data, few steps, no periodic validation."""
    return [
        "data.num_train_tokens=65536",
        "data.num_val_tokens=8192",
        "trainer.log_every_n_steps=1",
        "trainer.val_every_n_steps=1000",
        "trainer.val_batches=2",
        "optimizer.warmup_steps=2",
    ]


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject): two workers at most (tests/scheduling.py)."""
    return auto_workers()


EXCLUSIVITY = Exclusivity()
WORKER_LOCK = WorkerLock()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under xdist an exclusive test runs alone, every other one beside at most one more (tests/scheduling.py)."""
    exclusive = EXCLUSIVITY.needs(item)
    asked = time.monotonic()
    WORKER_LOCK.take(exclusive)
    started = time.monotonic()
    try:
        yield
    finally:
        EXCLUSIVITY.ran(item)
        if not (exclusive and nextitem is not None and EXCLUSIVITY.needs(nextitem)):
            WORKER_LOCK.release()
        record_timeline(item.nodeid, exclusive, asked, started, time.monotonic())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files holding exclusive tests first, then the heaviest (tests/scheduling.py); tests marked ``gpu`` run only
    where CUDA is present (a lent GPU machine), and are skipped here."""
    order_files(items)
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
