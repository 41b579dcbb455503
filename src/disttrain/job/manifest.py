"""What run.json records about the run, the code and the machine (its schema: ``diagnostics.manifest.RunManifest``)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from diagnostics.manifest import RunManifest, read_manifest
from disttrain.config.levers import catalogue_record
from disttrain.config.schema import HFDataConfig, LightningModuleConfig, RunConfig
from disttrain.data.hf import tokenizer_sha256
from disttrain.job.redaction import redact, redact_yaml_files
from disttrain.models.facts import ModelFacts
from disttrain.strategies.layout import ParallelLayout

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def versions() -> dict[str, str]:
    import hydra
    import lightning
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "hydra": hydra.__version__,
        "cuda": str(torch.version.cuda),
        "platform": platform.platform(),
    }


def git_commit(root: Path = PROJECT_ROOT) -> dict[str, Any] | None:
    """Commit of the code that ran (and whether it had local changes), or None outside a git checkout."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(dirty)}


def command_line() -> list[str]:
    return [sys.executable, *sys.argv]


def record_start(
    manifest: RunManifest,
    config: dict,
    run_cfg: RunConfig,
    parallel: ParallelLayout,
    facts: ModelFacts,
    checkpoint: Path | None,
    attempt: int,
    run_dir: Path,
) -> None:
    """Fill run.json's record of a run about to fit: its command and resolved ``config`` (credentials redacted:
    redaction.py), hardware, world, batch, model, code, where it resumed from and every attempt so far."""
    manifest.status = "running"
    manifest.command = redact(command_line())
    manifest.config = redact(config)
    manifest.hw, manifest.world, manifest.batch = run_cfg.hw, parallel.world, parallel.batch
    manifest.num_parameters, manifest.flops_per_token = facts.num_parameters, facts.flops_per_token
    lightning_module = isinstance(run_cfg.model, LightningModuleConfig)
    manifest.work = {
        "unit": "sample" if lightning_module else "token",
        "lightning_module": lightning_module,
        "automatic_optimization": facts.automatic_optimization,
        "tokens_per_sample": facts.tokens_per_sample,
    }
    manifest.levers = catalogue_record()
    manifest.versions, manifest.git = versions(), git_commit()
    manifest.resumed_from = str(checkpoint) if checkpoint else None
    manifest.restart_attempt = attempt
    manifest.attempts = [*attempts_so_far(run_dir, attempt), parallel.attempt_record(attempt)]
    manifest.strategy_resolved = run_cfg.strategy
    if isinstance(run_cfg.data, HFDataConfig):
        manifest.tokenizer_sha256 = tokenizer_sha256(run_cfg.data.tokenizer)
    # The warmup the run uses (a default too long for max_steps was shortened by prepare).
    if not lightning_module:  # whose optimizer is its own: the group's values are not what it ran with
        manifest.config["optimizer"]["warmup_steps"] = run_cfg.optimizer.warmup_steps
    if "compile" in manifest.config["model"]:  # null decided by the device and strategy (schema.py)
        manifest.config["model"]["compile"] = run_cfg.model.compile


def write_start(manifest: RunManifest, run_dir: Path) -> None:
    """Rank 0 writes the run's resolved config.yaml and run.json; Hydra's own copies lose their credentials."""
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(manifest.config)))
    redact_yaml_files([run_dir / ".hydra" / name for name in ("config.yaml", "overrides.yaml", "hydra.yaml")])
    manifest.write(run_dir)


def attempts_so_far(run_dir: Path, attempt: int) -> list[dict]:
    """The earlier attempts' records from run.json (a restart trains in the same run dir; an elastic one on
    another world size), so run.json lists every attempt's world size."""
    if attempt == 0:
        return []
    earlier, _ = read_manifest(run_dir)
    records = earlier.attempts if earlier is not None else []
    return [a for a in records if isinstance(a, dict) and a.get("attempt", attempt) < attempt]
