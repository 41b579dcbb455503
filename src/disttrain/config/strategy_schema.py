"""Typed schemas of the strategy group: one frozen dataclass per strategy (conf/strategy/<name>.yaml), the
union a run holds, and the options their fields take."""

from __future__ import annotations

from dataclasses import dataclass, replace

COMM_HOOKS = ("none", "bf16", "fp16", "powersgd")


@dataclass(frozen=True)
class DDPConfig:
    """DistributedDataParallel; ``comm_hook`` changes what the gradient all-reduce sends (torch DDP comm hooks).

    ``bf16``/``fp16`` all-reduce a half-precision copy of each bucket (half the bytes of fp32 gradients);
    ``powersgd`` sends rank-``powersgd_rank`` factors of each weight matrix after ``powersgd_warmup_steps``
    optimizer steps of plain all-reduce.
    """

    name: str = "ddp"
    find_unused_parameters: bool = False
    # null: on for GPUs, where the views save a gradient-sized copy; off on CPU hosts, where the optimizer and
    # zero_grad over bucket views ran slower than over DDP's own gradients (benchmarks/overhead.py; RESULTS.md).
    # true/false force it.
    gradient_as_bucket_view: bool | None = None
    bucket_cap_mb: int = 25
    static_graph: bool = False
    # DDP broadcasts rank 0's buffers before every forward (torch's default). Constant buffers (rotary caches) do
    # not need it; two A/Bs of false on 2 CPU ranks disagreed (benchmarks/RESULTS.md): A/B it where you run.
    forward_sync_buffers: bool = True
    comm_hook: str = "none"  # none | bf16 | fp16 | powersgd
    powersgd_rank: int = 4  # rank of the P, Q factors: (rows + cols) x rank values per matrix instead of rows x cols
    powersgd_warmup_steps: int = 50  # plain all-reduce for this many optimizer steps first (torch: >= 2)
    powersgd_error_feedback: bool = True  # carry each rank's compression error into the next step's gradient

    def for_accelerator(self, accelerator: str) -> DDPConfig:
        """This config with a null ``gradient_as_bucket_view`` decided for ``accelerator`` (``gpu`` or ``cpu``)."""
        if self.gradient_as_bucket_view is not None:
            return self
        return replace(self, gradient_as_bucket_view=accelerator == "gpu")


@dataclass(frozen=True)
class FSDPConfig:
    """FSDP2 (``fully_shard`` on a DeviceMesh); parameters are sharded over the data-parallel axis."""

    name: str = "fsdp"
    reshard_after_forward: bool = True
    reduce_dtype: str = "fp32"  # gradient reduce-scatter dtype under mixed precision: fp32 | bf16
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    dp_replicate: int = 1  # HSDP: replica groups (e.g. nodes); parameters are sharded within each group
    # Expert parallelism (MoE models): experts sharded over groups of ep consecutive ranks, tokens exchanged by
    # all-to-all; the dense parts stay FSDP-sharded over every rank, experts FSDP-sharded over world / ep.
    ep: int = 1
    # Which experts each rank of an ep group holds, per MoE layer: a permutation of the expert ids whose k-th
    # E / ep entries are the experts of the group's k-th rank (null: contiguous, rank k holds [k E / ep, ...)).
    # One permutation applies to every layer. The report's expert_imbalance finding proposes balanced ones.
    expert_placement: list[list[int]] | None = None
    # A user's LightningModule (model._target_): the classes whose every instance is one FSDP unit (import paths,
    # e.g. [pkg.Block]); null: units chosen by size, each module holding >= fsdp_unit_min_params parameters not yet
    # in a unit below it. The module's top-level children are the roots, sharded last.
    fsdp_wrap: list[str] | None = None
    fsdp_unit_min_params: int = 1_000_000


@dataclass(frozen=True)
class MegatronConfig:
    """Megatron-style 3D parallelism from torch-native parts: DTensor tensor parallelism on the ``tp`` axis,
    ``torch.distributed.pipelining`` stages on ``pp``, FSDP2 on the data-parallel axis (``dp_type``).

    ``microbatches`` is the number of micro-batches each data-parallel rank runs per optimizer step (the
    pipeline's micro-batches; plain gradient accumulation when ``pp`` is 1).
    """

    name: str = "megatron"
    tp: int = 1
    pp: int = 1
    dp: int | str = "auto"  # "auto": world size / (tp x pp)
    dp_type: str = "fsdp"  # fsdp (shard over dp) | hsdp (shard within dp_shard, replicate across) | replicate
    dp_replicate: int = 1  # hsdp only: number of replica groups; parameters are sharded over dp / dp_replicate
    sequence_parallel: bool = False  # shard norm/dropout activations over tp along the sequence
    loss_parallel: bool = True  # vocab-parallel cross-entropy on the tp-sharded logits (no logits all-gather)
    schedule: str = "1f1b"  # pp > 1: gpipe | 1f1b | interleaved_1f1b | zero_bubble
    microbatches: int | None = None  # None: pp (the fewest 1F1B allows), 1 without pipelining
    virtual_stages: int = 1  # model chunks per pipeline rank: interleaved_1f1b (>= 2), zero_bubble (2: the V)
    activation_checkpointing: str = "none"  # none | selective (attention core) | full (whole block)

    @property
    def num_microbatches(self) -> int:
        if self.microbatches is not None:
            return self.microbatches
        return self.pp if self.pp > 1 else 1


@dataclass(frozen=True)
class DeepSpeedConfig:
    """DeepSpeed ZeRO (Lightning's DeepSpeedStrategy), sharding over the data-parallel ranks.

    Stage 1 partitions optimizer states, 2 also gradients, 3 also parameters. Bucket sizes are in elements, as
    DeepSpeed counts them.
    """

    name: str = "deepspeed"
    stage: int = 2  # ZeRO stage: 1 | 2 | 3
    # Offload (GPU profiles only): false | cpu (true) | nvme. The optimizer's states and step go to the host
    # (DeepSpeedCPUAdam), its states swapped to nvme_path under nvme; stage 3's parameter partitions to the host or to
    # nvme_path. nvme (ZeRO-Infinity) needs stage 3 and DeepSpeed's async I/O op (libaio), compiled at launch.
    offload_optimizer: bool | str = False
    offload_params: bool | str = False
    nvme_path: str | None = None  # a directory on a local NVMe drive; each run swaps in its own folder under it
    activation_checkpointing: bool = False  # recompute each transformer block in backward
    overlap_comm: bool = True  # overlap gradient reduction with backward
    contiguous_gradients: bool = True  # copy gradients into one contiguous buffer as they are produced
    reduce_bucket_size: int = 200_000_000  # elements reduced at once (DeepSpeed's default)
    allgather_bucket_size: int = 200_000_000  # elements all-gathered at once (stage 1/2 parameter updates)
    param_persistence_threshold: int = 100_000  # stage 3: parameters with fewer elements stay whole on every rank

    @property
    def optimizer_offload_device(self) -> str | None:
        return offload_device(self.offload_optimizer)

    @property
    def param_offload_device(self) -> str | None:
        return offload_device(self.offload_params)

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.optimizer_offload_device, self.param_offload_device)


OFFLOAD_DEVICES = ("cpu", "nvme")


def offload_device(value: bool | str) -> str | None:
    """An offload option's device: None (off), "cpu" (true or cpu) or "nvme"; anything else is left to validation."""
    if value is True:
        return "cpu"
    if value is False or value is None or str(value).lower() in ("false", "none", ""):
        return None
    return str(value).lower()


@dataclass(frozen=True)
class AutoStrategyConfig:
    """Let the planner pick the fastest layout predicted to fit, DDP, FSDP2, DeepSpeed or Megatron-style (resolved
    before launch: strategies/auto.py)."""

    name: str = "auto"


StrategyConfig = DDPConfig | FSDPConfig | DeepSpeedConfig | MegatronConfig
