"""Typed schemas for every config group.

These frozen dataclasses are what ``src/`` and ``diagnostics/`` receive; only ``pipelines/`` and
``disttrain.training.build`` ever see a DictConfig. ``disttrain.config.parse`` turns the composed Hydra config into
a ``RunConfig`` and reports unknown keys and wrong types with the dotted key that is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from disttrain.config.hardware import HardwareProfile
from disttrain.config.hf_source import read_source
from disttrain.config.strategy_schema import AutoStrategyConfig, StrategyConfig

# The reference transformer's choices: the names the schema, the validation and the model all use.
Norm = Literal["layernorm", "rmsnorm"]


Mlp = Literal["gelu", "swiglu"]


PosEmb = Literal["learned", "rope"]


RouterGate = Literal["softmax", "sigmoid"]


NORMS: tuple[str, ...] = get_args(Norm)


MLPS: tuple[str, ...] = get_args(Mlp)


POS_EMBS: tuple[str, ...] = get_args(PosEmb)


ROUTER_GATES: tuple[str, ...] = get_args(RouterGate)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the reference transformer; one dataclass covers the GPT-2 and Llama families."""

    name: str = "gpt-nano"
    family: str = "gpt"  # gpt | llama: informational, behaviour comes from the fields below
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int | None = None  # None means n_heads (multi-head); fewer means grouped-query attention
    ffn_hidden: int = 512
    vocab_size: int = 256
    seq_len: int = 128
    norm: Norm = "layernorm"
    mlp: Mlp = "gelu"
    pos_emb: PosEmb = "learned"
    rope_theta: float = 10000.0
    bias: bool = True
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    dropout: float = 0.0
    init_std: float = 0.02
    # torch.compile of every block and of the loss; None: on where it pays, on GPUs under DDP or FSDP (decided by
    # ``for_accelerator``), off on CPU (inductor's CPU compile takes longer than a CPU-sized run trains).
    compile: bool | None = None
    # torch.compile's mode for the blocks: None (inductor's default), "reduce-overhead" (CUDA graphs: one replay per
    # block instead of its kernel launches, for host-bound steps), "max-autotune", "max-autotune-no-cudagraphs".
    compile_mode: str | None = None
    # Rows of a learned position table when they are not seq_len: an HF model's own table (GPT-2's n_positions,
    # 1024, whatever seq_len it trains at). The reference model's table has seq_len rows; it leaves this null.
    position_rows: int | None = None
    # Mixture of experts (models/moe.py): num_experts > 0 replaces every block's MLP by a routed MoE layer of
    # num_experts experts (each an MLP of expert_ffn_hidden, no biases), top_k of them per token, plus
    # num_shared_experts that every token uses (DeepSeek). 0 experts: a dense model.
    num_experts: int = 0
    top_k: int = 2
    expert_ffn_hidden: int | None = None  # None: ffn_hidden; smaller with more experts = fine-grained experts
    num_shared_experts: int = 0
    router_gate: RouterGate = "softmax"  # softmax (Mixtral, OLMoE) | sigmoid (DeepSeek-V3) scores per expert
    router_norm_topk: bool = True  # renormalise the top-k gate weights to sum to 1
    aux_loss_coef: float = 0.01  # load-balancing loss (Switch/GShard: E * sum_e f_e P_e) weight in the objective
    z_loss_coef: float = 0.001  # router z-loss (ST-MoE: mean logsumexp(logits)^2) weight
    # Expert capacity = capacity_factor x tokens x top_k / num_experts per expert and rank; assignments beyond it
    # are dropped (the token keeps its residual). None: dropless, every assignment is computed.
    capacity_factor: float | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_hidden(self) -> int:
        return self.ffn_hidden if self.expert_ffn_hidden is None else self.expert_ffn_hidden

    @property
    def learned_position_rows(self) -> int:
        """Rows of the learned position table (counted as parameters; 0 work per token)."""
        return self.seq_len if self.position_rows is None else self.position_rows

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class CustomModelConfig:
    """A user's own model: ``target`` is the import path of an ``nn.Module`` class or factory.

    It is called with ``kwargs`` and must map token ids ``[batch, seq]`` to logits ``[batch, seq, vocab]``.
    ``vocab_size`` and ``seq_len`` are required because the data and the FLOPs accounting need them.
    """

    target: str
    vocab_size: int
    seq_len: int
    name: str = "custom"
    compile: bool | None = None  # None (what the reference presets carry): off, a user's model is compiled on request
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LightningModuleConfig:
    """A user's own ``LightningModule``, trained as written: its steps, ``configure_optimizers``, logging and hooks.

    ``target`` is the import path of the class (or of a function returning one); ``kwargs`` are the other
    ``model.*`` keys, instantiated by Hydra (nested ``_target_`` nodes, ``_partial_`` included). The work unit is
    the sample; a module that says what a token is (``tokens_per_sample``) is also counted in tokens.
    """

    target: str
    name: str = "lightning"
    compile: bool | None = None  # None: off (torch.compile of the module on request)
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HFModelConfig:
    """A Hugging Face ``transformers`` causal LM, from a local directory or an inline config (never the hub).

    ``path``: a directory with ``config.json`` and safetensors weights (``save_pretrained``'s layout), loaded as
    they are. ``config``: the fields of a HF config (``model_type`` plus its shape), built with the project's
    deterministic init. Exactly one of the two is set. ``family: hf`` tells it apart from the reference shapes.
    """

    name: str = "hf"
    family: str = "hf"
    path: str | None = None
    config: dict[str, Any] | None = None
    seq_len: int = 128
    init_std: float | None = None  # None: the config's initializer_range (0.02 when it has none)
    attn_implementation: str = "sdpa"  # transformers' attention kernel: sdpa | eager
    compile: bool | None = None  # None: off (torch.compile of the whole HF model on request)

    @property
    def vocab_size(self) -> int:
        return int(read_source(self.path, self.config).vocab_size)  # read (and cached) only where it is needed


# The synthetic source's dense V^order x V table of float64 probabilities: 512 MiB, plus as much again for the
# sampling table (data/markov.py builds it; validation refuses a shape beyond it before launch).
MAX_TABLE_ENTRIES = 2**26


@dataclass(frozen=True)
class SyntheticDataConfig:
    """Seeded order-k Markov source whose entropy rate is known exactly (the loss floor)."""

    name: str = "synthetic"
    vocab_size: int = 16
    order: int = 2
    concentration: float = 0.05  # Dirichlet alpha of each next-token distribution: lower = more predictable
    num_train_tokens: int = 2_000_000
    num_val_tokens: int = 131_072
    source_seed: int = 1234  # fixes the Markov source itself, independent of the training seed
    num_workers: int = 0
    pin_memory: bool | None = None  # None: pinned where batches go to a GPU (faster, asynchronous copies)


@dataclass(frozen=True)
class TextDataConfig:
    """Any local text file as byte-level tokens (vocab 256)."""

    path: str
    name: str = "text"
    val_fraction: float = 0.05
    num_workers: int = 0
    pin_memory: bool | None = None  # None: pinned where batches go to a GPU (faster, asynchronous copies)


@dataclass(frozen=True)
class TokensDataConfig:
    """nanoGPT-style uint16 token files: ``train_path`` (and optionally ``val_path``) as flat .bin memmaps."""

    train_path: str
    vocab_size: int
    name: str = "tokens"
    val_path: str | None = None  # None: the tail ``val_fraction`` of train_path is held out
    val_fraction: float = 0.05
    num_workers: int = 0
    pin_memory: bool | None = None  # None: pinned where batches go to a GPU (faster, asynchronous copies)


@dataclass(frozen=True)
class HFDataConfig:
    """Local files read with ``datasets``, tokenized with a local tokenizer, packed into ``seq_len`` windows.

    Documents are joined with the EOS id into one stream; the token stream is cached on disk under
    ``cache_dir`` (keyed by the files, the tokenizer and these settings) and memory-mapped by every rank.
    """

    train_files: list[str]
    tokenizer: str  # a tokenizer.json written by `tokenizers`, or a directory AutoTokenizer reads
    name: str = "hf"
    val_files: list[str] | None = None  # None: the tail val_fraction of the training stream is held out
    format: str = "auto"  # auto (from the extension) | json | parquet | csv | text | disk (save_to_disk dir)
    text_column: str = "text"
    eos_token: str | None = None  # None: the tokenizer's own EOS (or <eos>, </s>, <|endoftext|> in its vocab)
    val_fraction: float = 0.05
    cache_dir: str = "~/.cache/disttrain/tokens"
    num_workers: int = 0
    pin_memory: bool | None = None  # None: pinned where batches go to a GPU (faster, asynchronous copies)


@dataclass(frozen=True)
class CustomDataConfig:
    """A user's own LightningDataModule: ``target`` is its import path, called with ``kwargs``."""

    target: str
    name: str = "custom"
    kwargs: dict[str, Any] = field(default_factory=dict)


DataConfig = SyntheticDataConfig | TextDataConfig | TokensDataConfig | HFDataConfig | CustomDataConfig


OPTIMIZERS = ("adamw", "onebit_adam")


@dataclass(frozen=True)
class PrecisionConfig:
    name: str = "fp32"  # fp32 | bf16-mixed | bf16-true | fp16-mixed | fp8
    # fp8 only: torchao's float8 scaling of the linear layers' inputs, weights and gradients: tensorwise (one scale
    # per tensor; with FSDP2 the weights are all-gathered in fp8) or rowwise (one scale per row: more accurate).
    recipe: str | None = None
    # fp8 only: the LM head's matmul in fp8 too. Left in bf16 by default (as torchtitan leaves it: the logits feed a
    # softmax over the whole vocabulary); it is a fifth of llama-1b's matmul FLOPs. Compare the loss with bf16's.
    fp8_head: bool = False

    @property
    def lightning(self) -> str:
        # fp8 trains under bf16 autocast; torchao's Float8Linear runs the linear layers' matmuls in fp8.
        return {
            "fp32": "32-true",
            "bf16-mixed": "bf16-mixed",
            "bf16-true": "bf16-true",
            "fp16-mixed": "16-mixed",
            "fp8": "bf16-mixed",
        }[self.name]

    @property
    def compute_dtype(self) -> str:
        """The dtype the run's time is judged against for MFU (fp8 against bf16's peak, as torchtitan reports it:
        the embedding, attention and head still run in bf16, and the ratio stays comparable with a bf16 run)."""
        return {"fp32": "fp32", "bf16-mixed": "bf16", "bf16-true": "bf16", "fp16-mixed": "fp16", "fp8": "bf16"}[
            self.name
        ]

    @property
    def fp8(self) -> bool:
        return self.name == "fp8"

    @property
    def planner(self) -> str:
        """The precision the planner models: fp8 as bf16-mixed (the same states, traffic and non-linear layers; its
        linear layers at bf16's speed, so the predicted step is an upper bound for an fp8 run)."""
        return "bf16-mixed" if self.fp8 else self.name


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr``.

    ``onebit_adam`` (DDP only) is AdamW for ``freeze_steps`` optimizer steps, then 1-bit Adam: Adam's variance
    frozen, each rank's momentum averaged over ranks in 1 bit per value with error feedback instead of the fp32
    gradient all-reduce (strategies/onebit.py).
    """

    name: str = "adamw"  # adamw | onebit_adam
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    # torch's fused AdamW kernel (one launch for all parameters): None = fused where every parameter lives on a GPU
    # (DeepSpeed's CPU offload and FSDP2 cpu_offload step on the host), false = torch's foreach default.
    fused: bool | None = None
    # onebit_adam: optimizer steps of plain AdamW (gradients all-reduced in fp32) before the variance freezes and
    # the compressed momentum exchange starts; the variance must have settled by then (1-bit Adam's paper: ~15-25%
    # of training; the learning-rate warm-up done).
    freeze_steps: int = 100


@dataclass(frozen=True)
class TrainerConfig:
    max_steps: int = 220
    micro_batch_size: int = 16  # sequences per rank per forward/backward
    global_batch_size: int | None = None  # sequences per optimizer step over all ranks; None: micro x dp
    grad_clip: float = 1.0  # 0 disables clipping
    val_every_n_steps: int = 50
    val_batches: int = 8
    ckpt_every_n_steps: int = 100  # 0: no step checkpoints at all (throw-away and benchmark runs)
    log_every_n_steps: int = 10
    seed: int = 1337
    deterministic: bool = False
    num_threads: int | None = None  # torch intra-op threads per process; None: OMP_NUM_THREADS, else cores / local
    keep_last_n: int | None = None  # checkpoints to keep (newest first); None keeps all
    nan_policy: str = "stop"  # non-finite loss/gradients: stop | skip (skip the update, up to max_nan_skips)
    max_nan_skips: int = 10  # with nan_policy=skip: steps skipped before the run stops anyway
    max_restarts: int = 0  # relaunch all local ranks this many times after a failure, resuming (like torchrun's)


@dataclass(frozen=True)
class LoggerConfig:
    name: str = "csv"  # csv | wandb | tensorboard
    project: str = "disttrain"
    mode: str = "offline"  # wandb only: offline | online
    entity: str | None = None


@dataclass(frozen=True)
class DiagnosticsConfig:
    """What the diagnostics layer records during a run (see conf/diagnostics/)."""

    name: str = "default"
    enabled: bool = True
    step_every: int = 1  # write a step record every N optimizer steps
    gather_every: int = 10  # all-gather per-rank timings every N steps (the straggler signal)
    sample_interval_s: float = 2.0  # NVML / CPU sampler period
    profile: bool = True  # one torch.profiler window
    profile_wait_steps: int = 10
    profile_active_steps: int = 3
    calibrate: bool = True  # measure this device's matmul FLOP/s at start-up (the calibrated peak)
    hang_timeout_s: float = 600.0
    report: bool = True


@dataclass(frozen=True)
class TrialConfig:
    """The Optuna trial a sweep job reports its validation losses to (``trial.*``: set by hydra/sweeper=optuna for
    each job, so a pruner can stop it); all None outside such a sweep."""

    storage: str | None = None
    study: str | None = None
    number: int | None = None

    @property
    def linked(self) -> bool:
        return self.storage is not None and self.study is not None and self.number is not None


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs, validated and typed."""

    model: ModelConfig | CustomModelConfig | HFModelConfig | LightningModuleConfig
    data: DataConfig
    strategy: StrategyConfig | AutoStrategyConfig
    precision: PrecisionConfig
    hw: HardwareProfile
    optimizer: OptimizerConfig
    trainer: TrainerConfig
    logger: LoggerConfig
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    dry_run: bool = False
    resume: str | None = None
    # Resume the weights (and step, schedule, data position) but start the optimizer state afresh, on purpose.
    resume_weights_only: bool = False
    check_memory: bool = True  # refuse a run the planner predicts will not fit its devices
    # A finished run dir whose measured speeds (matmul, memory, links) the planner uses instead of the datasheet's:
    # strategy=auto chooses with them, and the prediction in run.json uses them when this run measured none.
    calibration: str | None = None
    # What the job returns to a Hydra sweeper (hydra/sweeper=optuna): the final validation loss (minimized), the
    # training tokens/s or samples/s (maximized), or a metric the module logs (config/objective.py: its direction).
    objective: str = "val_loss"
    trial: TrialConfig = field(default_factory=TrialConfig)


AnyModelConfig = ModelConfig | CustomModelConfig | HFModelConfig | LightningModuleConfig


def token_seq_len(model: AnyModelConfig) -> int | None:
    """Tokens per sample of a token model; None for a LightningModule, whose samples are its batches' rows."""
    return None if isinstance(model, LightningModuleConfig) else model.seq_len


COMPILED_STRATEGIES = ("ddp", "fsdp")


# torchao's fp8 matmuls (torch._scaled_mm) take dimensions in multiples of 16.
FP8_DIM_MULTIPLE = 16


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes that record CUDA graphs


def with_compile_decided(cfg: RunConfig) -> RunConfig:
    """``model.compile: null`` decided: on for the reference model on GPUs under DDP or FSDP (per-block compile is the
    torchtitan recipe; both are measured in benchmarks/gpu_suite.py), off elsewhere. ``model.compile_mode: null``
    decided for compiled blocks: CUDA graphs where ``cudagraphs_by_default`` holds, inductor's default elsewhere.
    ``strategy=auto`` is decided again once it names a strategy."""
    model = cfg.model
    if not isinstance(model, ModelConfig) or cfg.strategy.name == "auto":
        return cfg
    on = model.compile
    if on is None:
        on = cfg.hw.accelerator == "gpu" and cfg.strategy.name in COMPILED_STRATEGIES
    mode = model.compile_mode
    if on and mode is None and cudagraphs_by_default(cfg):
        mode = "reduce-overhead"
    if (on, mode) == (model.compile, model.compile_mode):
        return cfg
    return replace(cfg, model=replace(model, compile=on, compile_mode=mode))


def cudagraphs_by_default(cfg: RunConfig) -> bool:
    """Where compiled blocks are recorded as CUDA graphs unless ``model.compile_mode`` says otherwise: a dense model
    on one GPU under strategy=ddp in bf16-mixed or fp8, where graphs removed the host's launch gaps with the loss
    alike (the H200 figures: benchmarks/RESULTS.md, "Figures moved from the code"). Several ranks, fp16's loss
    scaler and MoE routing were not measured with graphs; they keep inductor's default."""
    model = cfg.model
    return (
        isinstance(model, ModelConfig)
        and cfg.hw.accelerator == "gpu"
        and cfg.strategy.name == "ddp"
        and cfg.hw.world_size == 1
        and not model.is_moe
        and cfg.precision.name in ("bf16-mixed", "fp8")
    )
