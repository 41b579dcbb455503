"""Degree math and compose-time checks for ``strategy=megatron`` (pure: no torch, no processes).

Every rule here is a hard constraint of the layout, checked before any process starts so the message can name
the key and a value that works.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.config.errors import ConfigError, did_you_mean
from disttrain.config.hf import hf_sequence_parallel_problem, hf_shape, load_hf_config
from disttrain.config.schema import CustomModelConfig, HFModelConfig, LightningModuleConfig, ModelConfig
from disttrain.config.strategy_schema import MegatronConfig

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "zero_bubble")
DP_TYPES = ("fsdp", "hsdp", "replicate")
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class MegatronDegrees:
    """Parallel degrees of one run; mesh axes (outer to inner) ``pp, dp_replicate, dp_shard, tp``."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index on each mesh axis (row-major over ``pp, dp_replicate, dp_shard, tp``)."""
        rank, tp = divmod(rank, self.tp)
        rank, dp_shard = divmod(rank, self.dp_shard)
        pp, dp_replicate = divmod(rank, self.dp_replicate)
        return {
            "pp": pp,
            "dp_replicate": dp_replicate,
            "dp_shard": dp_shard,
            "tp": tp,
            "dp": dp_replicate * self.dp_shard + dp_shard,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def megatron_degrees(cfg: MegatronConfig, world_size: int) -> MegatronDegrees:
    """Resolve ``dp=auto`` and check ``dp x tp x pp = world`` and the data-parallel flavour."""
    for key in ("tp", "pp", "dp_replicate", "virtual_stages"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"strategy.{key}", f"must be >= 1, got {getattr(cfg, key)}", f"use strategy.{key}=1")
    if world_size % (cfg.tp * cfg.pp):
        valid = [f"tp={t} pp={p}" for t in _divisors(world_size) for p in _divisors(world_size // t)][:6]
        raise ConfigError(
            "strategy.tp",
            f"tp x pp = {cfg.tp} x {cfg.pp} does not divide the world size {world_size}",
            f"pick degrees whose product divides {world_size} (e.g. {', '.join(valid)}) or change hw.devices_per_node",
        )
    if cfg.dp == "auto":
        dp = world_size // (cfg.tp * cfg.pp)
    elif isinstance(cfg.dp, int) and not isinstance(cfg.dp, bool):
        dp = cfg.dp
        if dp * cfg.tp * cfg.pp != world_size:
            raise ConfigError(
                "strategy.dp",
                f"dp x tp x pp = {dp} x {cfg.tp} x {cfg.pp} = {dp * cfg.tp * cfg.pp}, not the world size {world_size}",
                f"use strategy.dp={world_size // (cfg.tp * cfg.pp)} (or strategy.dp=auto)",
            )
    else:
        raise ConfigError("strategy.dp", f"expected an integer or 'auto', got {cfg.dp!r}", "use strategy.dp=auto")
    if cfg.dp_type not in DP_TYPES:
        raise ConfigError(
            "strategy.dp_type",
            f"'{cfg.dp_type}' is not a data-parallel flavour{did_you_mean(cfg.dp_type, DP_TYPES)}",
            f"use one of {list(DP_TYPES)}",
        )
    if cfg.dp_type == "fsdp":
        if cfg.dp_replicate != 1:
            raise ConfigError(
                "strategy.dp_replicate",
                "only applies to strategy.dp_type=hsdp",
                "set strategy.dp_type=hsdp or remove it",
            )
        return MegatronDegrees(cfg.pp, 1, dp, cfg.tp)
    if cfg.dp_type == "replicate":
        return MegatronDegrees(cfg.pp, dp, 1, cfg.tp)
    if dp % cfg.dp_replicate:
        raise ConfigError(
            "strategy.dp_replicate",
            f"{cfg.dp_replicate} replica groups do not divide dp={dp}",
            f"use a divisor of {dp}: {_divisors(dp)}",
        )
    return MegatronDegrees(cfg.pp, cfg.dp_replicate, dp // cfg.dp_replicate, cfg.tp)


def validate_megatron(
    cfg: MegatronConfig,
    model: ModelConfig | CustomModelConfig | HFModelConfig | LightningModuleConfig,
    world_size: int,
    precision: str,
) -> MegatronDegrees:
    """Every compose-time rule of the 3D layout; returns the resolved degrees."""
    degrees = megatron_degrees(cfg, world_size)
    if isinstance(model, CustomModelConfig | LightningModuleConfig):
        raise ConfigError(
            "strategy",
            "strategy=megatron needs a tensor/pipeline plan, which the reference transformer and HF Llama-style "
            "models have and a user model (an nn.Module or LightningModule of yours) does not",
            "use strategy=ddp, fsdp or deepspeed for your own model (docs/user_modules.md: what TP/PP would take)",
        )
    hf = isinstance(model, HFModelConfig)
    if isinstance(model, HFModelConfig):
        model = _validate_hf_megatron(cfg, model)
    if precision == "fp16-mixed":
        raise ConfigError("precision", "strategy=megatron supports fp32 and bf16", "use precision=bf16-mixed")
    for key, value, choices in (
        ("schedule", cfg.schedule, SCHEDULES),
        ("activation_checkpointing", cfg.activation_checkpointing, RECOMPUTE),
    ):
        if value not in choices:
            raise ConfigError(
                f"strategy.{key}",
                f"'{value}' is not one of {list(choices)}{did_you_mean(value, choices)}",
                f"use strategy.{key}={choices[1]}",
            )
    for key, heads in (("n_heads", model.n_heads), ("n_kv_heads", model.kv_heads)):
        if heads % cfg.tp:
            ok = [t for t in _divisors(world_size) if model.n_heads % t == 0 and model.kv_heads % t == 0]
            raise ConfigError(
                "strategy.tp",
                f"tp={cfg.tp} does not divide model.{key}={heads} (each rank must hold whole heads)",
                f"use strategy.tp in {ok}",
            )
    if cfg.tp > 1 and model.vocab_size % cfg.tp:
        ok = [t for t in _divisors(world_size) if not (model.vocab_size % t or model.n_heads % t or model.kv_heads % t)]
        raise ConfigError(
            "strategy.tp",
            f"tp={cfg.tp} does not divide model.vocab_size={model.vocab_size} (vocab-parallel embedding and head)",
            f"use strategy.tp in {ok}" if hf else f"pad model.vocab_size to a multiple of {cfg.tp}",
        )
    if cfg.sequence_parallel and cfg.tp > 1 and model.seq_len % cfg.tp:
        raise ConfigError(
            "strategy.sequence_parallel",
            f"model.seq_len={model.seq_len} does not divide by tp={cfg.tp}",
            f"use a model.seq_len that is a multiple of {cfg.tp}, or strategy.sequence_parallel=false",
        )
    _validate_pipeline(cfg, model)
    return degrees


def _validate_hf_megatron(cfg: MegatronConfig, model: HFModelConfig) -> ModelConfig:
    """What the HF path supports: the architecture's own plain column/row-wise plan over its decoder ``layers``
    (Llama-family), pipeline stages of whole decoder layers with one stage per pipeline rank, sequence parallelism
    over the Llama layer layout, selective recomputation of the attention kernel; returns the model's shape for the
    common checks."""
    config = load_hf_config(model)
    plan = getattr(config, "base_model_tp_plan", None) or {}
    odd = sorted({style for style in plan.values() if style not in ("colwise", "rowwise")})
    # The plan names the decoder layers' projections under `layers.*`: the Llama layout the stages are cut from.
    llama_layout = bool(plan) and all(pattern.startswith("layers.") for pattern in plan)
    if not plan or odd or not llama_layout:
        why = (
            f"its plan uses styles {odd}"
            if odd
            else "its plan is not over decoder `layers`"
            if plan
            else "its transformers config has no base_model_tp_plan"
        )
        raise ConfigError(
            "strategy",
            f"strategy=megatron has no tensor-parallel plan for model_type '{config.model_type}' ({why}); "
            "Llama-family models (llama, mistral, qwen2, ...) are supported",
            "use strategy=fsdp, strategy=deepspeed or strategy=ddp for this model",
        )
    for key, bad, fix in (
        (
            "virtual_stages",
            cfg.virtual_stages != 1,
            "strategy.virtual_stages=1 (an HF model's pipeline rank holds one stage)",
        ),
        (
            "schedule",
            cfg.pp > 1 and cfg.schedule == "zero_bubble",
            "strategy.schedule=1f1b or gpipe (zero_bubble places two stages on a rank)",
        ),
    ):
        if bad:
            value = getattr(cfg, key)
            raise ConfigError(
                f"strategy.{key}", f"{value} is not supported with model=hf under strategy=megatron", f"use {fix}"
            )
    if cfg.sequence_parallel and cfg.tp > 1:
        problem = hf_sequence_parallel_problem(model)
        if problem is not None:
            raise ConfigError(
                "strategy.sequence_parallel",
                f"model_type '{config.model_type}' cannot shard its layers along the sequence: {problem}",
                "use strategy.sequence_parallel=false",
            )
    return hf_shape(model)


def _validate_pipeline(cfg: MegatronConfig, model: ModelConfig) -> None:
    m = cfg.num_microbatches
    if m < 1:
        raise ConfigError("strategy.microbatches", f"must be >= 1, got {m}", "use strategy.microbatches=null (= pp)")
    if cfg.pp == 1:
        if cfg.virtual_stages != 1:
            raise ConfigError(
                "strategy.virtual_stages",
                "only applies with pipeline parallelism (pp > 1)",
                "set strategy.virtual_stages=1",
            )
        return
    v = cfg.virtual_stages
    if cfg.schedule in MULTI_CHUNK_SCHEDULES and v < 2:
        raise ConfigError(
            "strategy.virtual_stages",
            f"schedule={cfg.schedule} runs several model chunks per pipeline rank, got virtual_stages={v}",
            "set strategy.virtual_stages=2",
        )
    if cfg.schedule == "zero_bubble" and v != 2:
        raise ConfigError(
            "strategy.virtual_stages",
            f"the zero_bubble V schedule holds exactly 2 chunks per rank, got {v}",
            "set strategy.virtual_stages=2",
        )
    if cfg.schedule not in MULTI_CHUNK_SCHEDULES and v != 1:
        raise ConfigError(
            "strategy.virtual_stages",
            f"schedule={cfg.schedule} runs one chunk per pipeline rank, got virtual_stages={v}",
            "set strategy.virtual_stages=1, or strategy.schedule=interleaved_1f1b",
        )
    stages = cfg.pp * v
    if model.n_layers % stages:
        ok = [p for p in _divisors(model.n_layers) if p > 1]
        raise ConfigError(
            "strategy.pp",
            f"model.n_layers={model.n_layers} does not split evenly into pp x virtual_stages = {cfg.pp} x {v} stages",
            f"use pp x virtual_stages in {ok}",
        )
    if cfg.schedule != "gpipe" and m < cfg.pp:
        raise ConfigError(
            "strategy.microbatches",
            f"schedule={cfg.schedule} needs at least pp={cfg.pp} micro-batches per step, got {m}",
            f"use strategy.microbatches>={cfg.pp} (or schedule=gpipe)",
        )
    if cfg.schedule == "interleaved_1f1b" and m % cfg.pp:
        raise ConfigError(
            "strategy.microbatches",
            f"interleaved_1f1b needs micro-batches divisible by pp={cfg.pp}, got {m}",
            f"use strategy.microbatches={-(-m // cfg.pp) * cfg.pp}",
        )
