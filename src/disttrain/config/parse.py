"""Turn the composed Hydra config into a typed ``RunConfig``.

Hydra already refuses overrides of keys that do not exist; this layer catches what it cannot: keys added
with ``+``, wrong types, missing required values (``???``) and unknown choices, each reported as a
``ConfigError`` that names the dotted key and the fix.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from disttrain.config.errors import ConfigError, did_you_mean
from disttrain.config.hardware import HardwareProfile, validate_profile
from disttrain.config.objective import OBJECTIVES, objective_problem
from disttrain.config.schema import (
    CustomDataConfig,
    CustomModelConfig,
    DiagnosticsConfig,
    HFDataConfig,
    HFModelConfig,
    LightningModuleConfig,
    LoggerConfig,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
    RunConfig,
    SyntheticDataConfig,
    TextDataConfig,
    TokensDataConfig,
    TrainerConfig,
    TrialConfig,
    with_compile_decided,
)
from disttrain.config.strategy_schema import AutoStrategyConfig, DDPConfig, DeepSpeedConfig, FSDPConfig, MegatronConfig

T = TypeVar("T")

GROUPS = ("model", "data", "strategy", "precision", "hw", "optimizer", "trainer", "logger", "diagnostics")
DATA_KINDS: dict[str, type] = {
    "synthetic": SyntheticDataConfig,
    "text": TextDataConfig,
    "tokens": TokensDataConfig,
    "hf": HFDataConfig,
}
STRATEGY_KINDS: dict[str, type] = {
    "ddp": DDPConfig,
    "fsdp": FSDPConfig,
    "deepspeed": DeepSpeedConfig,
    "megatron": MegatronConfig,
    "auto": AutoStrategyConfig,
}
PRECISIONS = ("fp32", "bf16-mixed", "bf16-true", "fp16-mixed", "fp8")
LOGGERS = ("csv", "wandb", "tensorboard")
# conf/train.yaml's own keys beside the groups; ``hydra`` is there when a caller composes with its config.
TOP_LEVEL = ("dry_run", "resume", "resume_weights_only", "check_memory", "calibration", "objective", "trial", "hydra")


def to_container(cfg: DictConfig | Mapping[str, Any], key: str) -> dict[str, Any]:
    """Resolve a config node to plain Python, turning a missing ``???`` value into a ConfigError."""
    if not isinstance(cfg, DictConfig):
        return dict(cfg)
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]
    except MissingMandatoryValue as err:
        missing = f"{key}.{err.full_key}" if err.full_key and not err.full_key.startswith(key) else err.full_key
        raise ConfigError(missing or key, "is required but not set", f"add {missing}=<value> to the command") from None
    except InterpolationResolutionError as err:
        raise ConfigError(key, f"cannot resolve an interpolation ({err})", "check the ${...} reference") from None


def _type_ok(value: Any, annotation: Any) -> tuple[bool, Any]:
    """Check ``value`` against a simple annotation; returns (ok, value coerced where lossless)."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        for arm in typing.get_args(annotation):
            ok, coerced = _type_ok(value, arm)
            if ok:
                return True, coerced
        return False, value
    if annotation is type(None):
        return value is None, value
    if origin is Literal:  # the allowed values are validate's to name (with the fix); here only the type
        return _type_ok(value, type(typing.get_args(annotation)[0]))
    if annotation is Any:
        return True, value
    if annotation is bool:
        return isinstance(value, bool), value
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if annotation is str:
        return isinstance(value, str), value
    if origin is list:
        # One path where a list is expected is the list of that path (data.train_files=/data/a.jsonl).
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            return False, value
        (arm,) = typing.get_args(annotation)
        checked = [_type_ok(item, arm) for item in items]
        return all(ok for ok, _ in checked), [item for _, item in checked]
    if origin is dict or annotation is dict:
        return isinstance(value, dict), value
    return isinstance(value, annotation), value


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is list:
        return f"list of {_type_name(typing.get_args(annotation)[0])}"
    if typing.get_origin(annotation) is Literal:
        return _type_name(type(typing.get_args(annotation)[0]))
    return "null" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def build_dataclass(cls: type[T], values: Mapping[str, Any], key: str) -> T:
    """Instantiate ``cls`` from ``values``, reporting unknown keys, missing keys and wrong types by name."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        if name not in fields:
            raise ConfigError(
                f"{key}.{name}",
                f"is not a setting of {key}{did_you_mean(name, fields)}",
                f"remove it; valid keys are {sorted(fields)}",
            )
        ok, coerced = _type_ok(value, hints[name])
        if not ok:
            raise ConfigError(
                f"{key}.{name}",
                f"expected {_type_name(hints[name])}, got {value!r}",
                f"set {key}.{name} to a {_type_name(hints[name])}",
            )
        kwargs[name] = coerced
    for name, f in fields.items():
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if no_default and name not in kwargs:
            raise ConfigError(f"{key}.{name}", "is required but not set", f"add {key}.{name}=<value>")
    return cls(**kwargs)


def _choice(values: Mapping[str, Any], key: str, choices: Mapping[str, Any] | tuple[str, ...]) -> str:
    name = values.get("name")
    if name not in choices:
        raise ConfigError(
            f"{key}.name",
            f"unknown {key} '{name}'{did_you_mean(str(name), choices)}",
            f"choose one of {sorted(choices)} (e.g. {key}={next(iter(choices))})",
        )
    return str(name)


def _split_target(values: dict[str, Any], reserved: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    own = {k: values[k] for k in reserved if k in values}
    kwargs = {k: v for k, v in values.items() if k not in reserved and k != "_target_"}
    return own, kwargs


# The keys that make a ``_target_`` model a token model (an nn.Module mapping ids to logits): the data and the FLOPs
# accounting need them. Without them the target is taken for a LightningModule; the job's start imports it and
# tells the two apart (models/user_module.py), since preflight must not import torch.
TOKEN_MODEL_KEYS = ("vocab_size", "seq_len")


def parse_model(values: dict[str, Any]) -> ModelConfig | CustomModelConfig | HFModelConfig | LightningModuleConfig:
    if values.get("family") == "hf":
        return build_dataclass(HFModelConfig, values, "model")
    if "_target_" in values:
        if not any(key in values for key in TOKEN_MODEL_KEYS):
            own, kwargs = _split_target(values, ("name", "compile"))
            target = {"target": values["_target_"], **own, "kwargs": kwargs}
            return build_dataclass(LightningModuleConfig, target, "model")
        own, kwargs = _split_target(values, ("name", "compile", *TOKEN_MODEL_KEYS))
        return build_dataclass(CustomModelConfig, {"target": values["_target_"], **own, "kwargs": kwargs}, "model")
    return build_dataclass(ModelConfig, values, "model")


def parse_data(values: dict[str, Any]):
    if "_target_" in values:
        own, kwargs = _split_target(values, ("name",))
        return build_dataclass(CustomDataConfig, {"target": values["_target_"], **own, "kwargs": kwargs}, "data")
    return build_dataclass(DATA_KINDS[_choice(values, "data", DATA_KINDS)], values, "data")


def parse_trial(node: Any) -> TrialConfig:
    """``trial.*`` (the sweeper sets it; a user only when running one trial of a study by hand)."""
    if node is None:
        return TrialConfig()
    trial = build_dataclass(TrialConfig, to_container(node, "trial"), "trial")
    given = [v is not None for v in (trial.storage, trial.study, trial.number)]
    if any(given) and not all(given):
        raise ConfigError(
            "trial", "needs storage, study and number together", "set all three, or none (hydra/sweeper=optuna does)"
        )
    return trial


def parse_run_config(cfg: DictConfig) -> RunConfig:
    """Typed view of a composed ``conf/train.yaml``; raises ConfigError on the first problem found."""
    # Hydra adds any ``+key=value``: a misspelt group (``+diagnostic.calibrate=false``) would otherwise be
    # carried through the whole run and change nothing.
    known = (*GROUPS, *TOP_LEVEL)
    for key in cfg:
        if str(key) not in known:
            raise ConfigError(
                str(key),
                f"is not a setting or config group of train{did_you_mean(str(key), known)}",
                f"remove it; the groups are {', '.join(GROUPS)} and the settings {', '.join(TOP_LEVEL[:-1])}",
            )
    for group in GROUPS:
        if group not in cfg or cfg[group] is None:
            raise ConfigError(group, "no option selected", f"select one, e.g. {group}=<option> (see conf/{group}/)")
    groups = {group: to_container(cfg[group], group) for group in GROUPS}
    if not isinstance(groups["strategy"], dict):
        raise ConfigError(
            "strategy", "must be a config group option", "use strategy=ddp, strategy=fsdp or strategy=deepspeed"
        )
    strategy_cls = STRATEGY_KINDS[_choice(groups["strategy"], "strategy", STRATEGY_KINDS)]
    _choice(groups["precision"], "precision", PRECISIONS)
    _choice(groups["logger"], "logger", LOGGERS)
    hw = build_dataclass(HardwareProfile, groups["hw"], "hw")
    validate_profile(hw)
    top = {k: cfg.get(k) for k in ("dry_run", "resume", "check_memory", "calibration", "objective")}
    top["resume_weights_only"] = cfg.get("resume_weights_only", False)
    for flag in ("dry_run", "check_memory", "resume_weights_only"):
        if not isinstance(top[flag], bool):
            raise ConfigError(flag, f"expected true or false, got {top[flag]!r}", f"use {flag}=true or {flag}=false")
    if top["resume"] is not None and not isinstance(top["resume"], str):
        raise ConfigError("resume", f"expected a path, got {top['resume']!r}", "use resume=outputs/<date>/<time>")
    if top["resume_weights_only"] and top["resume"] is None:
        raise ConfigError(
            "resume_weights_only", "only applies to a resumed run", "add resume=<run dir>, or drop resume_weights_only"
        )
    if top["calibration"] is not None and not isinstance(top["calibration"], str):
        raise ConfigError(
            "calibration", f"expected a run dir, got {top['calibration']!r}", "use calibration=outputs/<date>/<time>"
        )
    objective = top["objective"]
    problem = objective_problem(objective) if isinstance(objective, str) else f"expected a name, got {objective!r}"
    if problem is not None:
        raise ConfigError(
            "objective",
            problem,
            f"use one of {list(OBJECTIVES)} or a metric your module logs (objective=val_acc, objective=max:score)",
        )
    strategy: Any = build_dataclass(strategy_cls, groups["strategy"], "strategy")  # one of STRATEGY_KINDS' classes
    if isinstance(strategy, DDPConfig):  # gradient_as_bucket_view: null is decided by the device
        strategy = strategy.for_accelerator(hw.accelerator)
    return with_compile_decided(
        RunConfig(
            model=parse_model(groups["model"]),
            data=parse_data(groups["data"]),
            strategy=strategy,
            precision=build_dataclass(PrecisionConfig, groups["precision"], "precision"),
            hw=hw,
            optimizer=build_dataclass(OptimizerConfig, groups["optimizer"], "optimizer"),
            trainer=build_dataclass(TrainerConfig, groups["trainer"], "trainer"),
            logger=build_dataclass(LoggerConfig, groups["logger"], "logger"),
            diagnostics=build_dataclass(DiagnosticsConfig, groups["diagnostics"], "diagnostics"),
            dry_run=top["dry_run"],
            resume=top["resume"],
            resume_weights_only=top["resume_weights_only"],
            check_memory=top["check_memory"],
            calibration=top["calibration"],
            objective=top["objective"],
            trial=parse_trial(cfg.get("trial")),
        )
    )
