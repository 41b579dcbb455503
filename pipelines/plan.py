"""``python -m plan``: predict memory, communication, bubble and step time of every layout (see README).

Kept thin: Hydra in, typed request out, ``disttrain.planner`` does the math. A user's mistake becomes one line
and exit code 2, as in ``python -m train``. Nothing imports torch, and nothing is written to disk.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from disttrain.config.errors import USER_ERROR_EXIT_CODE, ConfigError
from disttrain.config.hardware import HardwareProfile, validate_profile
from disttrain.config.hf import reference_shape
from disttrain.config.parse import PRECISIONS, build_dataclass, parse_model, to_container
from disttrain.config.schema import PrecisionConfig, TrainerConfig
from disttrain.config.validate import validate_model
from disttrain.planner import Assumptions, ModelShape, Plan, model_shape, plan
from disttrain.planner.spec import assumption_problems, parse_parameter_count

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
OUTPUTS = ("table", "json")
# Keys of plan.yaml that train does not know: left out of the printed train command.
PLAN_ONLY = ("output", "limit", "num_parameters", "headroom", "throughput", "assumptions", "sequence_parallel")
# Model keys only the planner reads: the reference transformer has no such field.
PLAN_ONLY_MODEL = ("model.head_dim",)


def _check_hw(hw: HardwareProfile, precision: PrecisionConfig) -> None:
    dtype = precision.compute_dtype
    if hw.peak_flops(dtype) is None:
        raise ConfigError(
            "hw.peak_tflops",
            f"hw={hw.name} has no {dtype} peak, so no step time can be predicted",
            f"plan for a GPU profile (e.g. hw=8xa100) or add +hw.peak_tflops.{dtype}=<measured TFLOP/s>",
        )
    if hw.devices_per_node > 1 and not hw.intra_node_bandwidth_gbps:
        raise ConfigError("hw.intra_node_bandwidth_gbps", "is needed for more than one device per node", "set it")
    if hw.num_nodes > 1 and not hw.inter_node_bandwidth_gbps:
        raise ConfigError("hw.inter_node_bandwidth_gbps", "is needed for more than one node", "set it (GB/s per node)")


def named_by_its_counts(hw: HardwareProfile) -> HardwareProfile:
    """A preset named by its counts (8xa100, 2x8xh100) renamed after the nodes and devices this command set."""
    match = re.fullmatch(r"(?:(\d+)x)?(\d+)x(.+)", hw.name)
    if match is None or (int(match.group(1) or 1), int(match.group(2))) == (hw.num_nodes, hw.devices_per_node):
        return hw
    nodes = f"{hw.num_nodes}x" if hw.num_nodes > 1 else ""
    return dataclasses.replace(hw, name=f"{nodes}{hw.devices_per_node}x{match.group(3)}")


def _head_dim(values: dict) -> int | None:
    head_dim = values.pop("head_dim", None)
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1):
        raise ConfigError("model.head_dim", f"expected a positive width, got {head_dim!r}", "e.g. model.head_dim=128")
    return head_dim


def _sequence_parallel(cfg: DictConfig) -> bool | None:
    value = cfg.sequence_parallel
    if value is not None and not isinstance(value, bool):
        raise ConfigError("sequence_parallel", f"expected true, false or null, got {value!r}", "sequence_parallel=null")
    return value


def plan_from_config(cfg: DictConfig) -> Plan:
    """Typed request from the composed ``conf/plan.yaml``, then the plan; ConfigError on bad input."""
    if cfg.output not in OUTPUTS:
        raise ConfigError("output", f"'{cfg.output}' is not one of {list(OUTPUTS)}", "use output=table or output=json")
    if cfg.limit is not None and (not isinstance(cfg.limit, int) or cfg.limit < 1):
        raise ConfigError("limit", f"expected a positive row count or null, got {cfg.limit!r}", "use limit=20")
    hw = build_dataclass(HardwareProfile, to_container(cfg.hw, "hw"), "hw")
    validate_profile(hw)
    hw = named_by_its_counts(hw)
    precision = build_dataclass(PrecisionConfig, to_container(cfg.precision, "precision"), "precision")
    if precision.name not in PRECISIONS:
        raise ConfigError("precision.name", f"unknown precision '{precision.name}'", f"use one of {list(PRECISIONS)}")
    trainer = build_dataclass(TrainerConfig, to_container(cfg.trainer, "trainer"), "trainer")
    if trainer.micro_batch_size < 1 or (trainer.global_batch_size is not None and trainer.global_batch_size < 1):
        raise ConfigError("trainer.micro_batch_size", "batch sizes must be >= 1", "use trainer.micro_batch_size=1")
    if isinstance(cfg.headroom, bool) or not isinstance(cfg.headroom, (int, float)):
        raise ConfigError("headroom", f"expected a fraction, got {cfg.headroom!r}", "use headroom=0.1")
    values = {**to_container(cfg.assumptions, "assumptions"), "headroom": float(cfg.headroom)}
    assumptions = build_dataclass(Assumptions, values, "assumptions")
    for name, problem in assumption_problems(assumptions):
        key = name if name == "headroom" else f"assumptions.{name}"
        raise ConfigError(key, problem, f"set {key} inside that range (default {getattr(Assumptions(), name)})")
    model_values = to_container(cfg.model, "model")
    head_dim = _head_dim(model_values)
    model = parse_model(model_values)
    validate_model(model)
    sequence_parallel = _sequence_parallel(cfg)
    target: ModelShape | int
    if cfg.num_parameters is not None:
        if head_dim is not None:
            raise ConfigError("model.head_dim", "shapes a model, not a raw num_parameters", "drop one of the two")
        try:
            target = parse_parameter_count(cfg.num_parameters)
        except ValueError as err:
            raise ConfigError("num_parameters", str(err), "use e.g. num_parameters=7.5B") from None
    elif (shape := reference_shape(model)) is not None:
        target = model_shape(shape, head_dim)
    else:
        raise ConfigError("model", "the planner needs the reference transformer's shape", "add num_parameters=<count>")
    _check_hw(hw, precision)
    try:
        return plan(
            target,
            hw,
            precision=precision.name,
            micro_batch_size=trainer.micro_batch_size,
            global_batch_size=trainer.global_batch_size,
            seq_len=model.seq_len,
            assumptions=assumptions,
            sequence_parallel=sequence_parallel,
        )
    except ValueError as err:
        raise ConfigError(
            "trainer.global_batch_size", str(err), "use a multiple of micro_batch_size x world size"
        ) from None


def measured_tokens_per_s(cfg: DictConfig) -> float | None:
    """``throughput.tokens_per_s``: a measured global rate to express as MFU/HFU, or None."""
    value = cfg.throughput.tokens_per_s
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError("throughput.tokens_per_s", f"expected a positive rate, got {value!r}", "e.g. =250000")
    return float(value)


def train_prefix() -> str | None:
    """``python -m train`` with this command's model/hw/precision choices and its model/hw/trainer overrides;
    None when a plan-only model key (``model.head_dim``) shapes a model train cannot build."""
    hydra_cfg = HydraConfig.get()
    choices = [f"{group}={hydra_cfg.runtime.choices[group]}" for group in ("model", "hw", "precision")]
    kept = [o for o in hydra_cfg.overrides.task if o.lstrip("+~").split("=")[0].split(".")[0] not in PLAN_ONLY]
    kept = [o for o in kept if o.split("=")[0] not in ("model", "hw", "precision", "trainer.global_batch_size")]
    if any(o.lstrip("+~").split("=")[0] in PLAN_ONLY_MODEL for o in kept):
        return None
    return " ".join(["python -m train", *choices, *kept])


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="plan")
def main(cfg: DictConfig) -> None:
    try:
        result = plan_from_config(cfg)
        tokens_per_s = measured_tokens_per_s(cfg)
    except ConfigError as err:
        print(f"disttrain: config error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT_CODE)
    from disttrain.planner.render import json_payload, print_plan

    if cfg.output == "json":
        print(json.dumps(json_payload(result, tokens_per_s), indent=2))
        return
    from rich.console import Console

    # A raw count or a plan-only shape names no model train could build: give the strategy overrides alone.
    prefix = (train_prefix() if result.shape.known else None) or "strategy overrides:"
    print_plan(Console(width=None if sys.stdout.isatty() else 220), result, prefix, cfg.limit, tokens_per_s)


if __name__ == "__main__":
    main()
