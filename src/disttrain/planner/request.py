"""The typed request of ``python -m plan``: the composed ``conf/plan.yaml`` checked key by key.

The planner's inputs differ from a run's (a raw ``num_parameters``, ``model.head_dim``, assumptions, a measured
rate), so they get their own request type, here beside the planner that reads it (config/ never
imports the planner); a mistake is a ``ConfigError`` naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig

from disttrain.config.calibration import load_calibration
from disttrain.config.errors import ConfigError, did_you_mean
from disttrain.config.hardware import HardwareProfile, validate_profile
from disttrain.config.hf import reference_shape
from disttrain.config.parse import GROUPS, PRECISIONS, TOP_LEVEL, build_dataclass, parse_data, parse_model, to_container
from disttrain.config.schema import (
    CustomDataConfig,
    HFModelConfig,
    LightningModuleConfig,
    PrecisionConfig,
    TrainerConfig,
)
from disttrain.config.validate import validate_model
from disttrain.planner import Assumptions, ModelShape, model_shape
from disttrain.planner.calibrated import assumptions_for, calibrated_profile
from disttrain.planner.footprint import ModuleFootprint, footprint_notes, footprint_shape
from disttrain.planner.measured import MeasuredParts
from disttrain.planner.spec import assumption_problems, parse_parameter_count

OUTPUTS = ("table", "json")
# Measures a user's LightningModule on its datamodule's batch at a micro-batch (training/footprint.py): passed in
# from the edge, since measuring runs the module (torch) and the planner does not import it.
Measure = Callable[[LightningModuleConfig, CustomDataConfig | None, int], ModuleFootprint]


@dataclass(frozen=True)
class PlanRequest:
    target: ModelShape | int  # a shape, or a raw parameter count
    hw: HardwareProfile
    precision: PrecisionConfig
    trainer: TrainerConfig
    assumptions: Assumptions
    sequence_parallel: bool | None  # None: the planner tries both
    seq_len: int
    sources: dict[str, str]  # hw figure -> measured | datasheet | none
    parts: MeasuredParts | None = None  # calibration=RUN_DIR's measured block, edges and optimizer step
    notes: tuple[str, ...] = ()  # what a measured module's plan stands on (planner/footprint.py)


def _check_hw(hw: HardwareProfile, precision: PrecisionConfig) -> None:
    dtype = precision.compute_dtype
    if hw.peak_flops(dtype) is None:
        raise ConfigError(
            "hw.peak_tflops",
            f"hw={hw.name} has no {dtype} peak, so no step time can be predicted",
            f"pass calibration=<a run dir of this machine> (its measured speeds; a CPU run trains in fp32: add "
            f"precision=fp32), plan for a GPU profile (e.g. hw=8xa100), or add +hw.peak_tflops.{dtype}=<TFLOP/s>",
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


# conf/plan.yaml's own keys. A train group or setting is kept too: the printed train command carries it.
PLAN_KEYS = (
    "model", "hw", "trainer", "precision", "output", "limit", "num_parameters", "calibration", "headroom",
    "sequence_parallel", "throughput", "assumptions",
)  # fmt: skip


def check_top_level_keys(cfg: DictConfig) -> None:
    """A ``+key`` neither plan nor train has (a misspelt group) is refused: Hydra composes any, and the train
    command the plan prints would be refused for it."""
    known = dict.fromkeys([*PLAN_KEYS, *GROUPS, *TOP_LEVEL])
    for key in map(str, cfg):
        if key not in known:
            raise ConfigError(
                key,
                f"is not a setting of plan or train{did_you_mean(key, known)}",
                f"remove it; plan's settings are {', '.join(PLAN_KEYS)}",
            )


def parse_plan_request(cfg: DictConfig, measure: Measure | None = None) -> PlanRequest:
    """The typed request of a composed ``conf/plan.yaml``; ConfigError names the key and the fix on bad input.
    ``measure``: how a LightningModule of the user's is measured (without it, one is refused)."""
    check_top_level_keys(cfg)
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
    if isinstance(model, LightningModuleConfig):
        return _module_request(cfg, model, hw, precision, trainer, assumptions, measure)
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
        if isinstance(model, HFModelConfig):  # transformers' MoE blocks have no TP plan under strategy=megatron
            target = dataclasses.replace(target, megatron_experts=False)
    else:
        raise ConfigError("model", "the planner needs the reference transformer's shape", "add num_parameters=<count>")
    profile = calibrated_profile(hw, load_calibration(cfg.get("calibration"), hw), precision.compute_dtype)
    _check_hw(profile.hw, precision)
    return PlanRequest(
        target,
        profile.hw,
        precision,
        trainer,
        assumptions_for(profile, assumptions),
        sequence_parallel,
        model.seq_len,
        profile.sources,
        profile.parts,
    )


def _module_request(
    cfg: DictConfig,
    model: LightningModuleConfig,
    hw: HardwareProfile,
    precision: PrecisionConfig,
    trainer: TrainerConfig,
    assumptions: Assumptions,
    measure: Measure | None,
) -> PlanRequest:
    """A user's LightningModule, measured at the planned micro-batch on its datamodule's batch (``data._target_``)."""
    if measure is None:
        raise ConfigError(
            "model._target_",
            "this caller of the planner cannot measure a LightningModule (it does not run torch)",
            "plan it with python -m plan ~model +model._target_=... ~data +data._target_=...",
        )
    if cfg.num_parameters is not None:
        raise ConfigError("num_parameters", "sizes a model the planner does not know; yours is counted", "drop it")
    data = parse_data(to_container(cfg.data, "data")) if "data" in cfg else None
    footprint = measure(model, data if isinstance(data, CustomDataConfig) else None, trainer.micro_batch_size)
    profile = calibrated_profile(hw, load_calibration(cfg.get("calibration"), hw), precision.compute_dtype)
    _check_hw(profile.hw, precision)
    return PlanRequest(
        footprint_shape(model.target, footprint),
        profile.hw,
        precision,
        trainer,
        assumptions_for(profile, assumptions),
        sequence_parallel=None,
        seq_len=1,
        sources=profile.sources,
        parts=profile.parts,  # a run's timing of this very module (training/module_probe.py); another's stand out
        notes=footprint_notes(footprint),
    )


def measured_tokens_per_s(cfg: DictConfig) -> float | None:
    """``throughput.tokens_per_s``: a measured global rate to express as MFU/HFU, or None."""
    value = cfg.throughput.tokens_per_s
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError("throughput.tokens_per_s", f"expected a positive rate, got {value!r}", "e.g. =250000")
    return float(value)
