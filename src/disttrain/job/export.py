"""``python -m train export=<run dir or checkpoint> [export_to=<file.pt>]``: one consolidated weights file.

The checkpoint is found as ``resume=`` finds it (a run dir means its newest complete checkpoint). Its model weights
are written as one ``torch.save`` file under the model's own parameter names (default
``<run dir>/export/step<N>.pt``); for a ``model=hf`` run also in Hugging Face format next to it
(``step<N>.hf/``, ``from_pretrained``-loadable), using the run's recorded config for the model's shape. No ranks are
started: one process reads the checkpoint, whichever strategy and world size wrote it.
"""

from __future__ import annotations

from pathlib import Path

from hydra import initialize_config_dir

from disttrain.checkpoint.resume import find_resume_point, newest_complete, run_dir_of
from disttrain.config.errors import ConfigError
from disttrain.config.parse import parse_run_config
from disttrain.config.schema import HFModelConfig, LightningModuleConfig, RunConfig

KEYS = ("export", "export_to")


def export_arguments(argv: list[str]) -> dict[str, str] | None:
    """``{"export": ..., "export_to": ...}`` when the command is an export, else None (a training command)."""
    if not any(arg.startswith("export=") for arg in argv):
        return None
    args: dict[str, str] = {}
    for arg in argv:
        pair = arg.split("=", 1)
        if len(pair) != 2 or pair[0] not in KEYS:
            raise ConfigError(
                "export", f"'{arg}' is not an export option", "use export=<run dir or checkpoint> [export_to=<file.pt>]"
            )
        args[pair[0]] = pair[1]
    return args


def run_export(args: dict[str, str], conf_dir: Path) -> list[Path]:
    """Write the export files; returns their paths."""
    from disttrain.checkpoint.export import MODEL_PREFIX, export_hf, export_lightning_checkpoint, export_state_dict

    try:
        checkpoint = find_resume_point(args["export"]).checkpoint
    except ConfigError as err:  # the same lookup as resume=, named after this command's key
        raise ConfigError("export", err.problem, err.fix.replace("resume", "export")) from None
    default = run_dir_of(checkpoint) / "export" / f"{checkpoint.name.removesuffix('.ckpt')}.pt"
    out = Path(args.get("export_to") or default).expanduser()
    if out.exists():
        raise refuse_existing_export(out)
    run_cfg = recorded_run_config(args["export"], conf_dir)
    lightning_module = run_cfg is not None and isinstance(run_cfg.model, LightningModuleConfig)
    try:
        written = [export_state_dict(checkpoint, out, prefix="" if lightning_module else MODEL_PREFIX)]
        if lightning_module:  # also loadable with the user's own YourModule.load_from_checkpoint
            written.append(export_lightning_checkpoint(checkpoint, out.with_suffix(".ckpt")))
    except FileExistsError:  # another export of the same checkpoint wrote it first
        raise refuse_existing_export(out) from None
    if run_cfg is not None and isinstance(run_cfg.model, HFModelConfig):
        written.append(export_hf(checkpoint, run_cfg.model, out.with_suffix(".hf"), run_cfg.trainer.seed))
    return written


def refuse_existing_export(out: Path) -> ConfigError:
    return ConfigError(
        "export_to", f"'{out}' exists already; an export never writes over a file", "pass another export_to="
    )


def recorded_run_config(target: str, conf_dir: Path) -> RunConfig | None:
    """The typed config of the run the checkpoint belongs to (None without a Hydra record: a copied checkpoint)."""
    from disttrain.job.prepare import compose_for_resume

    if not (run_dir_of(Path(target).expanduser()) / ".hydra" / "overrides.yaml").is_file():
        return None
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        return parse_run_config(compose_for_resume(target, []))


def export_final_hf(run_cfg: RunConfig, ckpt_dir: Path, run_dir: Path) -> Path | None:
    """A model=hf run ends with its final weights in HF format under RUN_DIR/hf_model."""
    if not isinstance(run_cfg.model, HFModelConfig):
        return None
    last = newest_complete(ckpt_dir)
    if last is None:
        return None
    from disttrain.checkpoint.export import export_hf  # torch and transformers: only for an HF run's end

    return export_hf(last.checkpoint, run_cfg.model, run_dir / "hf_model", run_cfg.trainer.seed)
