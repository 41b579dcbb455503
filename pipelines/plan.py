"""``python -m plan``: predict memory, communication, bubble and step time of every layout (see docs/planner.md).

Kept thin: Hydra in, typed request out, ``disttrain.planner`` does the math. A user's mistake becomes one line
and exit code 2, as in ``python -m train``. Nothing imports torch, and nothing is written to disk.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from disttrain.config.errors import USER_ERROR_EXIT_CODE, ConfigError
from disttrain.config.schema import CustomDataConfig, LightningModuleConfig
from disttrain.launch.console import drop_import_chatter
from disttrain.planner import Plan, plan
from disttrain.planner.footprint import ModuleFootprint
from disttrain.planner.render import json_payload, print_plan
from disttrain.planner.request import PlanRequest, measured_tokens_per_s, parse_plan_request

drop_import_chatter()  # before anything here imports transformers or torchao

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
# Keys of plan.yaml that train does not know: left out of the printed train command.
PLAN_ONLY = ("output", "limit", "num_parameters", "headroom", "throughput", "assumptions", "sequence_parallel")
# Model keys only the planner reads: the reference transformer has no such field.
PLAN_ONLY_MODEL = ("model.head_dim",)


def measure_module(
    model: LightningModuleConfig, data: CustomDataConfig | None, micro_batch_size: int
) -> ModuleFootprint:
    """A user's LightningModule measured on meta (training/footprint.py); torch is imported only for one."""
    from disttrain.training.footprint import measure_footprint

    return measure_footprint(model, data, micro_batch_size)


def plan_from_config(cfg: DictConfig) -> Plan:
    """Typed request from the composed ``conf/plan.yaml``, then the plan; ConfigError on bad input."""
    return plan_request(parse_plan_request(cfg, measure_module))


def plan_request(request: PlanRequest) -> Plan:
    try:
        return plan(
            request.target,
            request.hw,
            precision=request.precision.planner,
            micro_batch_size=request.trainer.micro_batch_size,
            global_batch_size=request.trainer.global_batch_size,
            seq_len=request.seq_len,
            assumptions=request.assumptions,
            sequence_parallel=request.sequence_parallel,
            # fp8 composes with DDP and FSDP2 only (config/validate.py): plan what it can launch.
            strategies=("ddp", "fsdp") if request.precision.fp8 else None,
            parts=request.parts,
        )
    except ValueError as err:
        raise ConfigError(
            "trainer.global_batch_size", str(err), "use a multiple of micro_batch_size x world size"
        ) from None


def train_prefix() -> str | None:
    """``python -m train`` with this command's model/hw/precision choices and its model/hw/trainer overrides;
    None when a plan-only model key (``model.head_dim``) shapes a model train cannot build."""
    hydra_cfg = HydraConfig.get()
    chosen = hydra_cfg.runtime.choices
    # A group the command deleted (``~model`` for a LightningModule's ``+model._target_=``) has no choice.
    choices = [f"{group}={chosen[group]}" for group in ("model", "hw", "precision") if chosen.get(group)]
    kept = [o for o in hydra_cfg.overrides.task if o.lstrip("+~").split("=")[0].split(".")[0] not in PLAN_ONLY]
    kept = [o for o in kept if o.split("=")[0] not in ("model", "hw", "precision", "trainer.global_batch_size")]
    if any(o.lstrip("+~").split("=")[0] in PLAN_ONLY_MODEL for o in kept):
        return None
    return " ".join(["python -m train", *choices, *kept])


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="plan")
def main(cfg: DictConfig) -> None:
    try:
        request = parse_plan_request(cfg, measure_module)
        result = plan_request(request)
        tokens_per_s = measured_tokens_per_s(cfg)
    except ConfigError as err:
        print(f"disttrain: config error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT_CODE)
    if cfg.output == "json":
        print(json.dumps({**json_payload(result, tokens_per_s), "hw_sources": request.sources}, indent=2))
        return
    from rich.console import Console

    # A raw count or a plan-only shape names no model train could build: give the strategy overrides alone.
    trainable = result.shape.known or result.shape.measured_module
    prefix = (train_prefix() if trainable else None) or "strategy overrides:"
    console = Console(width=None if sys.stdout.isatty() else 220)
    print_plan(console, result, prefix, cfg.limit, tokens_per_s, request.sources, request.notes)
    if request.precision.fp8:
        print("precision=fp8: planned as bf16-mixed (same states and traffic; step time an upper bound), ddp/fsdp only")


def run() -> None:
    """Check the command as ``python -m train`` would (one line, exit code 2), then hand it to Hydra."""
    from disttrain.job.preflight import check_overrides

    try:
        check_overrides(sys.argv[1:], CONF_DIR, "plan")
    except ConfigError as err:
        print(f"disttrain: config error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT_CODE)
    main()


if __name__ == "__main__":
    run()
