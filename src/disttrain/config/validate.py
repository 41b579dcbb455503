"""Cross-field validation of a run's config, and the types of what a run derives from it (world layout, batch plan:
derived by the strategy's rules in strategies/layout.py).

Everything here is a pure function of the typed config plus, for file checks, the filesystem: it runs before
any process is spawned so a mistake costs a second, not a cluster allocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from disttrain.config.errors import ConfigError, did_you_mean, require_one_of, require_positive
from disttrain.config.hf import check_hf_weights, hf_shape, max_positions
from disttrain.config.objective import OBJECTIVES, split_objective
from disttrain.config.schema import (
    COMPILE_MODES,
    CUDAGRAPH_MODES,
    FP8_DIM_MULTIPLE,
    MAX_TABLE_ENTRIES,
    MLPS,
    NORMS,
    OPTIMIZERS,
    POS_EMBS,
    ROUTER_GATES,
    CustomDataConfig,
    CustomModelConfig,
    HFDataConfig,
    HFModelConfig,
    LightningModuleConfig,
    ModelConfig,
    RunConfig,
    SyntheticDataConfig,
    TextDataConfig,
    TokensDataConfig,
    TrainerConfig,
)


@dataclass(frozen=True)
class WorldLayout:
    num_nodes: int
    devices_per_node: int
    world_size: int
    data_parallel_size: int


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int
    accumulation: int

    @property
    def samples_per_rank_per_step(self) -> int:
        return self.micro_batch_size * self.accumulation


def validate_hf_model(m: HFModelConfig) -> None:
    """The HF source exists and is readable, and seq_len fits the model's position range."""
    require_positive("model.seq_len", m.seq_len)
    require_one_of("model.attn_implementation", m.attn_implementation, ("sdpa", "eager"))
    if m.init_std is not None:
        require_positive("model.init_std", m.init_std)
    hf_shape(m)  # reads the config: a bad path, model_type or field fails here, before launch
    check_hf_weights(m)  # and the weights' names and shapes (headers only)
    longest = max_positions(m)
    if longest is not None and m.seq_len > longest:
        raise ConfigError(
            "model.seq_len",
            f"{m.seq_len} is longer than the model's {longest} positions",
            f"use model.seq_len<={longest}",
        )


def validate_moe(m: ModelConfig) -> None:
    """The mixture-of-experts fields; a dense model (num_experts 0) must not set the MoE-only ones."""
    if m.num_experts < 0:
        raise ConfigError("model.num_experts", f"must be >= 0, got {m.num_experts}", "use 0 for a dense model")
    if not m.is_moe:
        if m.num_shared_experts:
            raise ConfigError(
                "model.num_shared_experts",
                "a dense model has no experts",
                "set model.num_experts (e.g. 8) or remove it",
            )
        return
    if not 1 <= m.top_k <= m.num_experts:
        raise ConfigError(
            "model.top_k",
            f"{m.top_k} experts per token out of model.num_experts={m.num_experts}",
            f"use 1 <= model.top_k <= {m.num_experts}",
        )
    require_positive("model.expert_ffn_hidden", m.expert_hidden)
    require_one_of("model.router_gate", m.router_gate, ROUTER_GATES)
    if m.num_shared_experts < 0:
        raise ConfigError("model.num_shared_experts", f"must be >= 0, got {m.num_shared_experts}", "use 0 or more")
    for key in ("aux_loss_coef", "z_loss_coef"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key}", f"must be >= 0, got {getattr(m, key)}", f"use e.g. model.{key}=0.01")
    if m.capacity_factor is not None and m.capacity_factor <= 0:
        raise ConfigError(
            "model.capacity_factor",
            f"must be > 0, got {m.capacity_factor}",
            "use e.g. model.capacity_factor=1.25 (tokens over capacity are dropped) or null for dropless",
        )


def validate_model(m: ModelConfig | CustomModelConfig | HFModelConfig | LightningModuleConfig) -> None:
    if isinstance(m, HFModelConfig):
        validate_hf_model(m)
        return
    if isinstance(m, LightningModuleConfig):
        return  # its class is imported, and told apart from a token model, as the job starts (models/user_module.py)
    require_positive("model.vocab_size", m.vocab_size)
    require_positive("model.seq_len", m.seq_len)
    if isinstance(m, CustomModelConfig):
        return
    for key in ("n_layers", "d_model", "n_heads", "ffn_hidden"):
        require_positive(f"model.{key}", getattr(m, key))
    require_one_of("model.norm", m.norm, NORMS)
    require_one_of("model.mlp", m.mlp, MLPS)
    require_one_of("model.pos_emb", m.pos_emb, POS_EMBS)
    if m.d_model % m.n_heads:
        raise ConfigError(
            "model.n_heads",
            f"d_model={m.d_model} is not divisible by n_heads={m.n_heads}",
            "pick n_heads that divides d_model",
        )
    if m.n_kv_heads is not None and (m.n_kv_heads < 1 or m.n_heads % m.n_kv_heads):
        raise ConfigError(
            "model.n_kv_heads",
            f"n_heads={m.n_heads} is not a multiple of n_kv_heads={m.n_kv_heads}",
            "use a divisor of n_heads (or null for multi-head attention)",
        )
    if m.pos_emb == "rope" and m.head_dim % 2:
        raise ConfigError("model.pos_emb", f"rope needs an even head_dim, got {m.head_dim}", "change d_model/n_heads")
    if m.position_rows is not None and m.position_rows != m.seq_len:
        raise ConfigError(
            "model.position_rows",
            f"{m.position_rows} rows: the reference model's learned position table has model.seq_len={m.seq_len}",
            "remove model.position_rows (it describes an HF model's own table)",
        )
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError("model.dropout", f"must be in [0, 1), got {m.dropout}", "use e.g. model.dropout=0.0")
    require_positive("model.init_std", m.init_std)
    if m.compile_mode is not None:
        require_one_of("model.compile_mode", m.compile_mode, COMPILE_MODES)
        if m.compile is False:
            raise ConfigError(
                "model.compile_mode",
                f"{m.compile_mode!r} applies to compiled blocks, and model.compile is off (off on CPU unless set)",
                "add model.compile=true, or drop model.compile_mode",
            )
    validate_moe(m)


def data_vocab_size(cfg: RunConfig) -> int | None:
    d = cfg.data
    if isinstance(d, SyntheticDataConfig | TokensDataConfig):
        return d.vocab_size
    if isinstance(d, TextDataConfig):
        return 256
    return None


def _check_file(key: str, path: str) -> None:
    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise ConfigError(key, f"'{path}' {what}", f"set {key} to an existing file (absolute, or relative to the cwd)")
    if p.stat().st_size == 0:
        raise ConfigError(key, f"'{path}' is empty", f"set {key} to a file with data in it")


def validate_lightning_module_data(cfg: RunConfig, plan: BatchPlan) -> None:
    """A user's LightningModule brings its own datamodule (the built-in data are token windows of model.seq_len),
    which is handed the run's micro-batch as ``batch_size``: a different ``data.batch_size`` would leave the batch
    plan (global batch, accumulation, samples/s) describing another run."""
    d = cfg.data
    if not isinstance(d, CustomDataConfig):
        raise ConfigError(
            "data",
            f"data={d.name} makes token windows of model.seq_len for a token model; a LightningModule "
            f"({getattr(cfg.model, 'target', cfg.model.name)}) reads the batches of its own datamodule",
            "add ~data +data._target_=your_pkg.YourDataModule (or give model.vocab_size and model.seq_len for a model "
            "that maps token ids to logits)",
        )
    given = d.kwargs.get("batch_size")
    if given is not None and given != plan.micro_batch_size:
        raise ConfigError(
            "data.batch_size",
            f"{given} differs from trainer.micro_batch_size={plan.micro_batch_size}, the micro-batch the run plans "
            "with (and passes to the datamodule as batch_size)",
            f"drop data.batch_size and set trainer.micro_batch_size={given}",
        )


def validate_data(cfg: RunConfig, plan: BatchPlan) -> None:
    d = cfg.data
    if isinstance(cfg.model, LightningModuleConfig):
        validate_lightning_module_data(cfg, plan)
        return
    if isinstance(d, CustomDataConfig):
        return
    require_positive("data.num_workers", d.num_workers, allow_zero=True)
    if isinstance(d, SyntheticDataConfig):
        require_positive("data.concentration", d.concentration)
        if d.vocab_size < 2:
            raise ConfigError("data.vocab_size", f"must be >= 2, got {d.vocab_size}", "use data.vocab_size=64")
        if d.order < 1:
            raise ConfigError("data.order", f"must be >= 1, got {d.order}", "use data.order=2")
        if d.vocab_size ** (d.order + 1) > MAX_TABLE_ENTRIES:  # the source's dense V^order x V table
            raise ConfigError(
                "data.order",
                f"vocab_size^(order+1) = {d.vocab_size}^{d.order + 1} transition entries is too large",
                "lower data.order or data.vocab_size",
            )
        windows = d.num_train_tokens // (cfg.model.seq_len + 1)
        if windows < plan.global_batch_size:
            raise ConfigError(
                "data.num_train_tokens",
                f"{d.num_train_tokens} tokens make {windows} sequences, fewer than one global batch "
                f"({plan.global_batch_size})",
                f"set data.num_train_tokens >= {plan.global_batch_size * (cfg.model.seq_len + 1)}",
            )
        if d.num_val_tokens < (cfg.model.seq_len + 1) * plan.data_parallel_size:
            raise ConfigError(
                "data.num_val_tokens",
                f"{d.num_val_tokens} tokens give no validation sequence for each of {plan.data_parallel_size} ranks",
                f"set data.num_val_tokens >= {(cfg.model.seq_len + 1) * plan.data_parallel_size}",
            )
    if isinstance(d, TextDataConfig):
        _check_file("data.path", d.path)
    if isinstance(d, TokensDataConfig):
        _check_file("data.train_path", d.train_path)
        if d.val_path is not None:
            _check_file("data.val_path", d.val_path)
        if d.vocab_size > 65536:
            raise ConfigError("data.vocab_size", "uint16 token files hold ids < 65536", "use a vocab <= 65536")
    if isinstance(d, TextDataConfig | TokensDataConfig | HFDataConfig) and not 0.0 < d.val_fraction < 1.0:
        raise ConfigError("data.val_fraction", f"must be in (0, 1), got {d.val_fraction}", "use 0.05")


def validate_reliability(t: TrainerConfig) -> None:
    """Checkpoint retention, the non-finite policy and restarts."""
    if t.keep_last_n is not None:
        require_positive("trainer.keep_last_n", t.keep_last_n)
    require_one_of("trainer.nan_policy", t.nan_policy, ("stop", "skip"))
    require_positive("trainer.max_nan_skips", t.max_nan_skips, allow_zero=True)
    require_positive("trainer.max_restarts", t.max_restarts, allow_zero=True)


FP8_RECIPES = ("tensorwise", "rowwise")
FP8_STRATEGIES = ("ddp", "fsdp", "auto")


def validate_fp8(cfg: RunConfig) -> None:
    """precision=fp8 needs fp8 tensor cores and a strategy whose model is torch's own nn.Linear layers (torchao being
    installed is the launching machine's to check: job/prepare.check_launchable)."""
    p = cfg.precision
    if not p.fp8:
        if p.recipe is not None:
            raise ConfigError("precision.recipe", f"only applies to precision=fp8 (got {p.name})", "drop it")
        if p.fp8_head:
            raise ConfigError("precision.fp8_head", f"only applies to precision=fp8 (got {p.name})", "drop it")
        return
    require_one_of("precision.recipe", p.recipe, FP8_RECIPES)
    if cfg.hw.accelerator != "gpu" or cfg.hw.peak_flops("fp8") is None:
        raise ConfigError(
            "precision",
            f"fp8 needs GPUs with fp8 tensor cores (compute capability 8.9+: L4, H100, H200); hw={cfg.hw.name} "
            "lists no fp8 peak (hw.peak_tflops.fp8)",
            "use precision=bf16-mixed here, or an fp8-capable hw profile (hw=8xh100, hw=8xh200, hw=1xl4)",
        )
    if cfg.strategy.name not in FP8_STRATEGIES:
        raise ConfigError(
            "precision",
            f"fp8 is composed with strategy=ddp and strategy=fsdp here, not strategy={cfg.strategy.name}",
            "use strategy=fsdp (fp8 all-gathers with precision.recipe=tensorwise) or strategy=ddp",
        )
    if p.fp8_head:
        validate_fp8_head(cfg)


def validate_fp8_head(cfg: RunConfig) -> None:
    """An fp8 head is a plain linear layer of the reference model or an HF model (checked when it is built) under
    DDP: FSDP's fp8 all-gather would hand a tied embedding its weight as an fp8 tensor subclass."""
    if cfg.strategy.name != "ddp":
        raise ConfigError(
            "precision.fp8_head",
            f"an fp8 LM head is composed with strategy=ddp here, not strategy={cfg.strategy.name}",
            "use strategy=ddp, or precision.fp8_head=false",
        )
    m = cfg.model
    if isinstance(m, ModelConfig) and m.vocab_size % FP8_DIM_MULTIPLE:
        raise ConfigError(
            "precision.fp8_head",
            f"fp8 matmuls need dimensions in multiples of {FP8_DIM_MULTIPLE}; the head has {m.vocab_size} rows",
            "use precision.fp8_head=false (the head stays bf16)",
        )


def validate_cudagraphs(cfg: RunConfig) -> None:
    """CUDA graphs replay fixed addresses and shapes: parameters that FSDP/ZeRO/TP gather into new memory each step,
    or experts that get a different number of tokens each step, would re-record graphs instead of replaying them."""
    m = cfg.model
    if not isinstance(m, ModelConfig) or m.compile_mode not in CUDAGRAPH_MODES:
        return
    if cfg.strategy.name != "ddp":
        raise ConfigError(
            "model.compile_mode",
            f"{m.compile_mode!r} records CUDA graphs, which replay under strategy=ddp only (not {cfg.strategy.name})",
            "use strategy=ddp, or model.compile_mode=max-autotune-no-cudagraphs",
        )
    if m.is_moe:
        raise ConfigError(
            "model.compile_mode",
            f"{m.compile_mode!r} records CUDA graphs, and a mixture of experts routes a varying number of tokens",
            "drop model.compile_mode for MoE models",
        )


def validate_onebit_adam(cfg: RunConfig) -> None:
    """``optimizer=onebit_adam`` replaces DDP's gradient all-reduce after its warm-up: DDP only, no other hook, and
    a warm-up that ends inside the run."""
    o, max_steps = cfg.optimizer, cfg.trainer.max_steps
    require_one_of("optimizer.name", o.name, OPTIMIZERS)
    if o.name != "onebit_adam":
        return
    if cfg.strategy.name != "ddp":
        raise ConfigError(
            "optimizer",
            f"onebit_adam averages the momentum in place of DDP's gradient all-reduce; strategy={cfg.strategy.name} "
            "reduces gradients its own way",
            "use strategy=ddp with optimizer=onebit_adam, or optimizer=adamw",
        )
    hook = getattr(cfg.strategy, "comm_hook", "none")
    if hook != "none":
        raise ConfigError(
            "strategy.comm_hook",
            f"onebit_adam sends no gradients after its warm-up, so the {hook} hook would only compress the warm-up's",
            "set strategy.comm_hook=none with optimizer=onebit_adam",
        )
    if not 1 <= o.freeze_steps < max_steps:
        raise ConfigError(
            "optimizer.freeze_steps",
            f"{o.freeze_steps} plain AdamW steps must be >= 1 (Adam's variance is frozen from them) and end before "
            f"trainer.max_steps={max_steps}",
            f"use 1 <= optimizer.freeze_steps < {max_steps} (about 15-25% of the run)",
        )


def validate_lightning_module_run(cfg: RunConfig) -> None:
    """What a user's LightningModule can be composed with: its own optimizer, no fp8 conversion of layers this
    project did not build (Megatron's plans are the strategy's own rule: config/degrees.py)."""
    if not isinstance(cfg.model, LightningModuleConfig):
        return
    if cfg.optimizer.name == "onebit_adam":
        raise ConfigError(
            "optimizer",
            "onebit_adam replaces the optimizer, and a LightningModule builds its own in configure_optimizers",
            "drop optimizer=onebit_adam (your configure_optimizers decides the optimizer)",
        )
    if cfg.precision.fp8:
        raise ConfigError(
            "precision",
            "fp8 converts the built-in models' linear layers; a LightningModule's layers are its own",
            "use precision=bf16-mixed (or convert your layers with torchao in your module)",
        )


def validate_objective(cfg: RunConfig) -> None:
    """The built-in models answer to the built-in objectives only; a metric name is a LightningModule's to log."""
    name, _ = split_objective(cfg.objective)
    if name in OBJECTIVES or isinstance(cfg.model, LightningModuleConfig):
        return
    raise ConfigError(
        "objective",
        f"unknown objective '{cfg.objective}'{did_you_mean(name, OBJECTIVES)} for model={cfg.model.name}: metric names "
        "apply to a LightningModule of yours, which logs its own",
        f"use one of {list(OBJECTIVES)} (what the job returns to hydra/sweeper=optuna)",
    )


def validate_fields(cfg: RunConfig) -> None:
    """Every config group's own checks and those across groups that need no strategy rule (the strategy's own, and
    the batch plan they imply, are strategies/layout.py's: ``validate_run``)."""
    validate_model(cfg.model)
    validate_lightning_module_run(cfg)
    validate_objective(cfg)
    validate_cudagraphs(cfg)
    t = cfg.trainer
    for key in ("max_steps", "micro_batch_size", "val_every_n_steps", "log_every_n_steps"):
        require_positive(f"trainer.{key}", getattr(t, key))
    if t.global_batch_size is not None:
        require_positive("trainer.global_batch_size", t.global_batch_size)
    require_positive("trainer.ckpt_every_n_steps", t.ckpt_every_n_steps, allow_zero=True)
    if t.ckpt_every_n_steps == 0 and t.max_restarts:
        raise ConfigError(
            "trainer.max_restarts",
            "a restart resumes from the newest checkpoint, and trainer.ckpt_every_n_steps=0 writes none",
            "set trainer.ckpt_every_n_steps > 0, or trainer.max_restarts=0",
        )
    require_positive("trainer.val_batches", t.val_batches, allow_zero=True)
    require_positive("trainer.grad_clip", t.grad_clip, allow_zero=True)
    if t.num_threads is not None:
        require_positive("trainer.num_threads", t.num_threads)
    validate_reliability(t)
    if not isinstance(cfg.model, LightningModuleConfig):  # whose optimizer is its configure_optimizers'
        validate_optimizer(cfg)
    validate_precision(cfg)


def validate_optimizer(cfg: RunConfig) -> None:
    t, o = cfg.trainer, cfg.optimizer
    require_positive("optimizer.lr", o.lr)
    require_positive("optimizer.eps", o.eps)
    require_positive("optimizer.weight_decay", o.weight_decay, allow_zero=True)
    require_positive("optimizer.warmup_steps", o.warmup_steps, allow_zero=True)
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, key) < 1.0:
            raise ConfigError(f"optimizer.{key}", f"must be in [0, 1), got {getattr(o, key)}", "use 0.9 / 0.95")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError("optimizer.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}", "use 0.1")
    if o.warmup_steps >= t.max_steps:
        raise ConfigError(
            "optimizer.warmup_steps",
            f"warmup ({o.warmup_steps} steps) does not end before trainer.max_steps={t.max_steps}",
            f"use optimizer.warmup_steps < {t.max_steps}",
        )
    validate_onebit_adam(cfg)


def validate_precision(cfg: RunConfig) -> None:
    on_cpu = cfg.hw.accelerator == "cpu"
    if cfg.precision.name == "fp16-mixed" and on_cpu:
        raise ConfigError(
            "precision",
            "fp16-mixed is not supported on CPU (Lightning would silently run bf16 instead)",
            "use precision=bf16-mixed on CPU, or a GPU hw profile for fp16",
        )
    validate_fp8(cfg)
    dg = cfg.diagnostics
    for key in ("step_every", "gather_every", "profile_active_steps"):
        require_positive(f"diagnostics.{key}", getattr(dg, key))
    require_positive("diagnostics.profile_wait_steps", dg.profile_wait_steps, allow_zero=True)
    require_positive("diagnostics.sample_interval_s", dg.sample_interval_s)
    require_positive("diagnostics.hang_timeout_s", dg.hang_timeout_s)
    if cfg.logger.name == "wandb":
        require_one_of("logger.mode", cfg.logger.mode, ("offline", "online"))


def validate_data_fits(cfg: RunConfig, plan: BatchPlan) -> None:
    """The data against the batch plan and the model: enough of it for the plan, ids inside the vocabulary."""
    validate_data(cfg, plan)
    vocab = data_vocab_size(cfg)
    if vocab is not None and not isinstance(cfg.model, LightningModuleConfig) and vocab > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"{cfg.model.vocab_size} is smaller than the data's vocabulary ({vocab})",
            f"set model.vocab_size>={vocab}",
        )
