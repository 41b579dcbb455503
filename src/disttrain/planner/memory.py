"""Memory per GPU, by strategy: model states, activations, communication/working buffers.

Each strategy's real layout, not one generic formula:

- DDP under Lightning precision: fp32 parameters, gradients and AdamW states (16 B/param); bf16/fp16-mixed adds
  autocast's 16-bit weight copies, which matmuls save for backward.
- FSDP2 as ``disttrain.strategies.fsdp`` applies it: dim-0 shards (padded per tensor) of fp32 parameters,
  gradients and states; per-layer working set of gathered 16-bit parameters and unsharded gradients; the root
  unit (embeddings, head) is never resharded.
- DeepSpeed ZeRO-1/2/3 (Rajbhandari et al. 2020): 16-bit parameters and gradients plus K = 12 bytes of fp32
  master weights, momentum and variance, partitioned per stage; optimizer/parameter offload; the stage-3
  working set is at least the largest layer (DeepSpeed's own ``estimate_zero3_model_states_mem_needs`` uses
  4 bytes x its parameters).
- strategy=megatron (TP x PP x DP): the pipeline rank's tensor-parallel slice under FSDP2 on the data-parallel
  ranks as ``strategy.dp_type`` sets them (fsdp, hsdp, replicate); for comparison, Megatron-LM's DDP with its
  distributed optimizer (6 + 12/d bytes per parameter, Megatron-Core "Distributed Optimizer" docs) or without
  it (18).

Totals add activations and buffers to model states although gradients grow while activations are freed in
backward: the sum is the conservative peak that DeepSpeed's and Megatron's estimators also use, and the real one
wherever a gradient buffer persists (DDP's buckets, ZeRO's flat buffers). One process without DDP's wrapper
allocates its gradients in backward: composed from a GPU probe's bytes, they take the activations' place there
(``MemoryBreakdown.grads_in_backward``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from disttrain.planner.bubble import last_stage_rank, microbatches_in_flight, stages_of_rank
from disttrain.planner.expert_shapes import ep_shard_parameters, local_expert_parameters
from disttrain.planner.shapes import ModelShape
from disttrain.planner.spec import MEGATRON_LM_DP_TYPES, Layout, Workload

ADAM_STATES = 2  # momentum and variance
# The loss's peak per logit, at the start of backward with every block's activations still saved: cross-entropy's
# saved fp32 log-probabilities (4 B), the fp32 gradient nll_loss hands log_softmax's backward (4 B) and the fp32
# gradient that backward writes (4 B), all three alive at once (in forward: the 16-bit logits, their fp32 copy and
# the log-probabilities, 10 B under mixed precision, 8 B in fp32). With 8 B the planner missed ~3 GiB on gpt2-124m
# (micro 16 x 1024, 50257 rows: 4 B x 0.82G logits = 3.07 GiB) against the H200's allocator peak: DDP 13.36 vs
# 16.61 GiB (-20%), FSDP2 12.83 vs 15.29 (-16%), llama-1b micro 4 x 2048 40.91 vs 44.44 (-8%); with 12 B: 16.43
# (-1%), 15.90 (+4%), 44.82 (+1%). Eager loss only: ``model.compile`` fuses the upcast and log-softmax (and frees
# block activations), which this formula does not model (an upper bound there).
LOGITS_BYTES_PER_ELEMENT = 12
# Lightning's DeepSpeedStrategy defaults (elements): reduce_bucket_size and allgather_bucket_size are 2e8 each;
# overlap_comm (on by default) double-buffers the reduce bucket.
DEEPSPEED_REDUCE_BUCKET = 200_000_000
DEEPSPEED_ALLGATHER_BUCKET = 200_000_000
# ZeRO-Infinity's swap buffers as DeepSpeed 0.19 sizes them with our config: the optimizer swapper pins
# offload_optimizer.buffer_count fp32 buffers of the largest sub-group (zero_optimization.sub_group_size, which
# strategies/deepspeed.py sets to NVME_SUB_GROUP under optimizer offload to nvme: at DeepSpeed's 1e9 the buffers
# would take more host memory than the states they swap); the parameter swapper offload_param.buffer_count buffers
# of offload_param.buffer_size elements (DeepSpeed's defaults).
NVME_SUB_GROUP = 100_000_000
NVME_OPTIMIZER_BUFFERS = 4
NVME_PARAM_BUFFERS = 5
NVME_PARAM_BUFFER_ELEMENTS = 100_000_000
# Megatron pipeline stages keep send/recv buffers for forward activations and backward gradients.
PIPELINE_P2P_BUFFERS = 4


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU. ``step_temporaries`` exist only in the optimizer step, after activations are freed."""

    params: int
    grads: int
    optimizer_states: int
    activations: int
    buffers: int
    step_temporaries: int = 0
    host: int = 0  # offloaded states kept in host memory for this GPU's rank (not part of ``total``)
    nvme: int = 0  # ZeRO-Infinity: offloaded states swapped to NVMe for this GPU's rank (not part of ``total``)
    # Gradients allocated in backward as it frees the activations (no persistent gradient buffer): then they are
    # not held beside all the activations at backward's start.
    grads_in_backward: bool = False

    @property
    def total(self) -> int:
        """The predicted peak: model states plus the larger of (activations + buffers) and step temporaries; where
        ``grads_in_backward``, the gradients join the step temporaries' side instead of the states."""
        if self.grads_in_backward:
            working = max(self.activations + self.buffers, self.grads + self.step_temporaries)
            return self.params + self.optimizer_states + working
        states = self.params + self.grads + self.optimizer_states
        return states + max(self.activations + self.buffers, self.step_temporaries)

    def to_json(self) -> dict[str, int]:
        keys = {
            "params": self.params,
            "grads": self.grads,
            "optimizer_states": self.optimizer_states,
            "activations": self.activations,
            "buffers": self.buffers,
            "total": self.total,
            "host": self.host,
        }
        return {**keys, "nvme": self.nvme} if self.nvme else keys  # only ZeRO-Infinity layouts swap to NVMe


def compute_bytes(precision: str) -> int:
    """Bytes per element of matmul inputs/outputs (activations, gathered weights)."""
    return 4 if precision == "fp32" else 2


def residual_bytes(strategy: str, precision: str) -> int:
    """Bytes per element of the residual stream (norm inputs, block inputs).

    Lightning's mixed precision for DDP is autocast over fp32 weights: the embedding output and residual adds
    stay fp32. FSDP2's bf16 param_dtype, DeepSpeed and Megatron run the whole model in 16 bits.
    """
    mixed_autocast = strategy == "ddp" and precision in ("bf16-mixed", "fp16-mixed")
    return 4 if mixed_autocast else compute_bytes(precision)


def layer_activation_bytes(
    shape: ModelShape,
    micro_batch_size: int,
    seq_len: int,
    *,
    act_bytes: int = 2,
    res_bytes: int = 2,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    flash_attention: bool = True,
    norm_statistics: bool = True,
) -> float:
    """Activation bytes one transformer layer keeps for backward, per micro-batch, on one TP rank.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", sec. 4 and
    Table 2) count, for a GPT layer with 16-bit activations: attention 11sbh + 5as^2b, MLP 19sbh, norms 4sbh.
    The same terms are counted here for any shape (GQA's smaller k/v, SwiGLU's four ffn tensors, dropout
    masks only when dropout > 0, flash attention's O(s) state instead of s x s scores), so that a GPT-3 shape
    with materialized attention reproduces the paper's ``sbh(34 + 5as/h)`` and its TP/SP/recompute rows when
    ``norm_statistics`` (the per-token mean/rstd the paper leaves out) is off. The tensors are those CUDA
    kernels save (fused RMSNorm keeps its 16-bit input; CPU's composite RMSNorm keeps two fp32 copies).
    """
    if not shape.known:
        return 0.0
    tokens = micro_batch_size * seq_len
    h, f = shape.d_model, shape.ffn_hidden
    q, kv = shape.n_heads * shape.head_dim, shape.kv_heads * shape.head_dim
    mask = 1 if shape.dropout > 0 else 0  # dropout keeps a 1-byte mask per element
    if recompute == "full":
        # Only the block input is kept; SP keeps its sequence shard.
        return res_bytes * tokens * h / (tp if sequence_parallel else 1)
    # Replicated over TP ranks unless sequence parallelism shards them: the two norm inputs, the inputs of the
    # QKV and first MLP projections, the two residual-branch dropout masks.
    replicated = tokens * h * (2 * res_bytes + 2 * act_bytes + 2 * mask)
    if norm_statistics:
        replicated += 2 * shape.norm_statistics * 4 * tokens
    # Split over TP ranks by heads / ffn columns: q, k, v, the attention output (the output projection's input:
    # flash kernels return it in a layout the reshape only views), the MLP intermediates.
    ffn_tensors = 4 if shape.swiglu else 2  # SwiGLU: w1 out, w3 out, silu(w1 out), product; GELU: input, output
    split: float = act_bytes * tokens * (q + 2 * kv + q + ffn_tensors * f)
    if recompute != "selective":  # selective recomputation drops the attention core's saved state
        split += attention_core_bytes(shape, micro_batch_size, seq_len, act_bytes, flash_attention)
    return replicated / (tp if sequence_parallel else 1) + split / tp


def attention_core_bytes(shape: ModelShape, micro_batch_size: int, seq_len: int, act_bytes: int, flash: bool) -> float:
    """What softmax(QK^T)V keeps beyond q, k, v and its output: s x s scores (and dropout) or flash's logsumexp."""
    heads, b, s = shape.n_heads, micro_batch_size, seq_len
    if flash:
        return 4 * heads * b * s
    dropout = (1 + act_bytes) * heads * s * s * b if shape.dropout > 0 else 0  # mask + dropped-out scores
    return act_bytes * heads * s * s * b + dropout


def output_activation_bytes(
    shape: ModelShape, micro_batch_size: int, seq_len: int, act_bytes: int, res_bytes: int, tp: int, sp: bool
) -> float:
    """The last stage's extra: final norm input, LM head input and the fp32 logits with their gradient."""
    if not shape.known:
        return 0.0
    tokens = micro_batch_size * seq_len
    hidden = tokens * shape.d_model * (res_bytes + act_bytes) / (tp if sp else 1)
    return hidden + LOGITS_BYTES_PER_ELEMENT * tokens * math.ceil(shape.vocab_size / tp)


def rank_parameters(shape: ModelShape, layout: Layout, rank: int) -> int:
    """Parameters pipeline rank ``rank`` holds on one TP rank: the layers of all its chunks, the embeddings
    where stage 0 runs, the head (and a tied embedding's second copy) where the last stage runs."""
    stages = stages_of_rank(rank, layout.pp, layout.virtual_stages, layout.schedule)
    return shape.pipeline_rank_parameters(layout.tp, layout.pp, stages, layout.pp * len(stages))


def activation_bytes(
    shape: ModelShape,
    layout: Layout,
    workload: Workload,
    stage: int,
    flash: bool,
    measured: tuple[float, float] | None = None,
) -> float:
    """Peak activation bytes on pipeline rank ``stage`` (the only rank when pp == 1).

    Stored layers times micro-batches in flight, the head's logits on the rank of the last stage, and the
    transient of recomputation: in backward one layer's full activations (or attention core) exist again.
    ``measured`` (``planner.measured.measured_activations``: a GPU probe of this model's block and edges) replaces
    the formula's layer and logits terms where blocks are not recomputed: what the allocator held, compiled kernels'
    savings and the loss's real work included (the formula counted gpt2-124m compiled +70% on an H200); split ``tp``
    ways under tensor parallelism like the formula's.
    """
    if not shape.known:
        return 0.0
    strategy, precision = layout.strategy, workload.precision
    act, res = compute_bytes(precision), residual_bytes(strategy, precision)
    tp, sp, pp = layout.tp, layout.sequence_parallel, layout.pp
    b, s = workload.micro_batch_size, workload.seq_len

    def layer(recompute: str) -> float:
        return layer_activation_bytes(
            shape, b, s, act_bytes=act, res_bytes=res, tp=tp, sequence_parallel=sp, recompute=recompute,
            flash_attention=flash,
        )  # fmt: skip

    use_measured = measured is not None and layout.recompute == "none"
    per_layer = measured[0] / tp if use_measured and measured is not None else layer(layout.recompute)
    in_flight = microbatches_in_flight(layout.schedule, pp, layout.per_schedule, layout.virtual_stages, stage)
    total = in_flight * (shape.n_layers // pp) * per_layer
    if stage == last_stage_rank(pp, layout.schedule):
        # The V schedule's last stage sits at its turning point on rank 0: each micro-batch's backward follows its
        # forward there, as on 1F1B's last stage, so one micro-batch's logits are alive at a time.
        logits_in_flight = 1.0 if layout.schedule == "zero_bubble" else in_flight
        output = measured[1] / tp if use_measured and measured is not None else None
        total += logits_in_flight * (
            output if output is not None else output_activation_bytes(shape, b, s, act, res, tp, sp)
        )
    if layout.recompute == "full":
        total += layer("none")
    elif layout.recompute == "selective":
        total += attention_core_bytes(shape, b, s, act, flash) / tp
    return total


def _ddp_states(shape: ModelShape, precision: str) -> MemoryBreakdown:
    p = 2 if precision == "bf16-true" else 4  # AdamW keeps its states in the parameters' dtype
    n = shape.num_parameters
    # gradient_as_bucket_view (the default on GPUs) makes DDP's buckets the gradients themselves: no extra copy.
    # torch's foreach AdamW materializes sqrt(v) for all parameters at once in the step.
    copies = autocast_copy_bytes(shape, precision)
    return MemoryBreakdown(p * n, p * n, ADAM_STATES * p * n, 0, copies, step_temporaries=p * n)


def autocast_copy_bytes(shape: ModelShape, precision: str) -> int:
    """Autocast's 16-bit copies of the linear weights over fp32 parameters, alive from forward to backward."""
    return 2 * shape.linear_parameters if precision in ("bf16-mixed", "fp16-mixed") else 0


def _fsdp_states(shape: ModelShape, layout: Layout, precision: str) -> MemoryBreakdown:
    p = 2 if precision == "bf16-true" else 4  # sharded (master) parameters, gradients and states
    gather = compute_bytes(precision)  # MixedPrecisionPolicy(param_dtype=bf16) under bf16-mixed
    reduce = 4 if precision in ("fp32", "bf16-mixed") else p  # reduce_dtype fp32 (the config default)
    shard = shape.fsdp_shard_parameters(layout.dp_shard)
    # The working set: the root unit stays gathered all step and its unsharded gradients live until the end of
    # backward; per block, the gathered current and prefetched unit (or every block without resharding) and one
    # block's unsharded gradient plus its reduce-scatter input.
    block = shape.block_parameters
    if layout.ep > 1:  # this rank's E / ep experts, sharded over the ranks holding them (planner/experts)
        shard = ep_shard_parameters(shape, layout.ep, layout.dp)
        block = block - shape.expert_parameters + local_expert_parameters(shape, layout.ep)
    gathered_blocks = 2 if layout.reshard_after_forward else shape.n_layers
    working = shape.root_parameters * (gather + reduce) + gathered_blocks * block * gather + block * (gather + reduce)
    if not shape.known and not layout.reshard_after_forward:
        # A raw count has no layers, but without resharding every parameter stays gathered from its forward to its
        # backward: the whole model in the compute dtype is a lower bound that follows from the count alone.
        working = shape.num_parameters * gather
    states = MemoryBreakdown(p * shard, p * shard, ADAM_STATES * p * shard, 0, working, step_temporaries=p * shard)
    if layout.offload_optimizer:  # CPUOffloadPolicy: sharded parameters, gradients and the step live on the host
        host = states.params + states.grads + states.optimizer_states
        return MemoryBreakdown(0, 0, 0, 0, working, host=host)
    return states


def _deepspeed_states(shape: ModelShape, layout: Layout, precision: str) -> MemoryBreakdown:
    """ZeRO-1/2/3 model states, as DeepSpeed allocates them.

    Against DeepSpeed's own ``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_..._needs`` (what the
    ``*_all_cold`` functions print; ``tests/unit/test_planner_deepspeed_estimators.py`` compares byte for byte):
    their GPU figure equals ``params + grads + optimizer_states`` plus the fp32 gradient partition (and, for
    stage 3, 4 bytes x the largest layer) here, for stage 2 with and without optimizer offload and stage 3 with
    optimizer (and parameter) offload. Where we differ, and why:

    - Stage 3 without offload: DeepSpeed's estimator counts 18 bytes per parameter partition; stage 3 also keeps
      the 16-bit gradient partition it reduces into (``grad_partitions_flat_buffer``, on the GPU unless the
      optimizer is offloaded) while the step upcasts it to fp32, so 20 here.
    - Partitions are ``ceil(P / N)`` (DeepSpeed pads flat buffers to equal partitions); the estimator floors
      ``18 P / N``. They agree when N divides P.
    - Stage 3 keeps the parameters under ``layout.persistence_threshold`` whole on every rank (beside their
      partition), and in fp32 still copies its parameter partition into a separate fp32 master partition
      (DeepSpeed 0.19's alias for same-dtype groups compares a device with a device name, never equal): K = 12.
      The estimator counts neither. Measured on a 2-rank CPU run of gpt-nano: 20.887 MB counted, 20.887 MB here.
    - The estimator has no reduce/all-gather buckets; Lightning's defaults allocate them (``buffers``).
    - Host memory: the estimator's CPU column is per node, times a 1.5 safety factor, and for stages 1/2 (no
      ``zero.Init``) the whole fp32 model loaded by every process at start-up; ``host`` here is the steady
      state one rank keeps there (fp32 master, momentum, variance, fp32 gradients, offloaded parameters), which
      times the node's GPUs equals the estimator's zero-init figure before its 1.5 factor.
    """
    n, dp, stage = shape.num_parameters, layout.dp, layout.zero_stage
    if precision == "fp32":
        p16, g16, k, fp32_grads = 4, 4, 2 * 4, 0  # no master copy: K = 8 (momentum, variance)
    else:
        p16, g16, k, fp32_grads = 2, 2, 12, 4  # K = 12: fp32 master, momentum, variance
    if stage == 3 and precision == "fp32":
        k = 3 * 4  # the fp32 master partition is a copy of the parameter partition, then momentum and variance
    shard = math.ceil(n / dp)
    persistent = shape.small_parameters(layout.persistence_threshold) if stage == 3 else 0
    params = p16 * (shard + persistent if stage == 3 else n)
    grads = g16 * (n if stage == 1 else shard)
    optimizer = k * shard
    # DeepSpeed upcasts this rank's gradient partition to fp32 for the optimizer step.
    buffers = fp32_grads * shard + 2 * g16 * min(DEEPSPEED_REDUCE_BUCKET, n)
    if stage == 3:
        buffers += 4 * shape.largest_module_parameters + p16 * min(DEEPSPEED_ALLGATHER_BUCKET, n)
    else:
        buffers += p16 * min(DEEPSPEED_ALLGATHER_BUCKET, n)
    host = nvme = 0
    if layout.nvme_optimizer:
        # ZeRO-Infinity: the states (K bytes per parameter of the partition) live on NVMe and are swapped through
        # DeepSpeed's pinned host buffers (offload_optimizer.buffer_count of them, each the largest sub-group in
        # fp32); the fp32 gradient partition stays on the host as under ZeRO-Offload.
        nvme += k * shard
        host += NVME_OPTIMIZER_BUFFERS * 4 * min(shard, NVME_SUB_GROUP) - k * shard
    if layout.nvme_params:
        # The 16-bit partition on NVMe, read through offload_param.buffer_count pinned buffers of buffer_size.
        nvme += p16 * shard
        host += NVME_PARAM_BUFFERS * p16 * nvme_param_buffer_elements(shape, dp) - p16 * shard
    if layout.offload_optimizer:
        # ZeRO-Offload: states, the step and the fp32 gradient partition move to the host. Stage 3 allocates its
        # gradient partition buffer on the CPU; stage 2 copies each reduced bucket into the CPU fp32 gradients.
        # Stage 1 does not partition gradients: the 16-bit gradients accumulate on the GPU until the step.
        host += optimizer + fp32_grads * shard
        buffers -= fp32_grads * shard
        optimizer = 0
        if stage > 1:
            host += g16 * shard if fp32_grads == 0 else 0  # fp32 training: the partition itself is the fp32 one
            grads = 0
    if layout.offload_params:  # ZeRO-Infinity: the 16-bit parameter partition lives on the host too
        host += p16 * shard
        params = p16 * persistent  # the persistent parameters stay whole on the device
    return MemoryBreakdown(params, grads, optimizer, 0, buffers, host=host, nvme=nvme)


def nvme_param_buffer_elements(shape: ModelShape, dp: int) -> int:
    """``offload_param.buffer_size`` under parameter offload to NVMe: DeepSpeed's 1e8 elements, or more where a
    parameter's partition would not fit one buffer (it asserts that at run time, after launch: llama-1b's 128256 x 2048
    embedding on one GPU is 262M elements). A leaf module's parameters bound its largest parameter."""
    return max(NVME_PARAM_BUFFER_ELEMENTS, math.ceil(shape.largest_module_parameters / max(dp, 1)))


def _megatron_states(shape: ModelShape, layout: Layout, workload: Workload, stage: int) -> MemoryBreakdown:
    buffers = 0
    if layout.pp > 1:
        tokens = workload.micro_batch_size * workload.seq_len
        per_tensor = tokens * shape.d_model * compute_bytes(workload.precision) / layout.tp
        buffers = int(PIPELINE_P2P_BUFFERS * per_tensor)
    if layout.dp_type in MEGATRON_LM_DP_TYPES:
        return _megatron_lm_states(shape, layout, workload, stage, buffers)
    # strategy=megatron: FSDP2 over the dp_shard ranks of each TP x pipeline slice (a shard group of one under
    # dp_type=replicate), params in their dtype, bf16 gathers under bf16-mixed, fp32 gradient reduction.
    precision = workload.precision
    p = 2 if precision == "bf16-true" else 4
    gather, reduce = compute_bytes(precision), 4
    stages = stages_of_rank(stage, layout.pp, layout.virtual_stages, layout.schedule)
    num_stages = layout.pp * len(stages)
    n = shape.pipeline_rank_parameters(layout.tp, layout.pp, stages, num_stages)
    shard = shape.pipeline_rank_parameters(layout.tp, layout.pp, stages, num_stages, layout.dp_shard)
    root = sum(t.tp_numel(layout.tp) for s in stages for t in shape.stage_root(num_stages, s))
    block = shape.block_tp_numel(layout.tp)
    if layout.pp > 1:
        # The engine keeps gathered weights under pipelining (every micro-batch's backward comes later): the whole
        # rank in the compute dtype, plus one block's unsharded gradient and the root's until the step.
        working = n * gather + block * (gather + reduce) + root * reduce
    else:  # blocks reshard after forward, the root never does: as strategy=fsdp
        working = root * (gather + reduce) + 2 * block * gather + block * (gather + reduce)
    return MemoryBreakdown(
        p * shard, p * shard, ADAM_STATES * p * shard, 0, working + buffers, step_temporaries=p * shard
    )


def _megatron_lm_states(
    shape: ModelShape, layout: Layout, workload: Workload, stage: int, buffers: int
) -> MemoryBreakdown:
    """Megatron-LM's DDP: 16-bit parameters and fp32 main gradients on every dp rank; fp32 master weights (when
    params are 16-bit), momentum and variance sharded over dp by the distributed optimizer or replicated without
    it (Megatron-Core "Distributed Optimizer" docs: 6 + 12/d and 18 bytes per parameter for bf16)."""
    n = rank_parameters(shape, layout, stage)
    p = 4 if workload.precision == "fp32" else 2
    master = 0 if workload.precision == "fp32" else 4
    optimizer_dp = layout.dp if layout.dp_type == "distributed_optimizer" else 1
    optimizer = math.ceil((master + ADAM_STATES * 4) * n / optimizer_dp)
    return MemoryBreakdown(p * n, 4 * n, optimizer, 0, buffers)


def model_state_bytes(shape: ModelShape, layout: Layout, workload: Workload, stage: int = 0) -> MemoryBreakdown:
    """Parameters, gradients, optimizer states and strategy buffers on one GPU (activations left at 0)."""
    if layout.strategy == "ddp":
        return _ddp_states(shape, workload.precision)
    if layout.strategy == "fsdp":
        return _fsdp_states(shape, layout, workload.precision)
    if layout.strategy == "deepspeed":
        return _deepspeed_states(shape, layout, workload.precision)
    if layout.strategy == "megatron":
        return _megatron_states(shape, layout, workload, stage)
    raise ValueError(f"unknown strategy {layout.strategy!r}")


def memory_per_gpu(
    shape: ModelShape,
    layout: Layout,
    workload: Workload,
    flash_attention: bool,
    measured: tuple[float, float] | None = None,
) -> MemoryBreakdown:
    """The peak over pipeline ranks (first: embeddings, most micro-batches in flight; the last stage's: head,
    logits; under the V schedule both are rank 0). ``measured``: a GPU probe's block and edges bytes
    (``activation_bytes``)."""
    stages = (0, layout.pp - 1) if layout.pp > 1 else (0,)
    best: MemoryBreakdown | None = None
    for stage in stages:
        states = model_state_bytes(shape, layout, workload, stage)
        activations = int(activation_bytes(shape, layout, workload, stage, flash_attention, measured))
        buffers = states.buffers
        probed = measured is not None and layout.recompute == "none" and layout.strategy == "ddp"
        if probed:
            # The probe's bytes hold the 16-bit weight copies its matmuls saved for backward (llama-1b's 2.3 GiB
            # counted twice put an H200 run +16%).
            buffers -= autocast_copy_bytes(shape, workload.precision)
        candidate = MemoryBreakdown(
            states.params,
            states.grads,
            states.optimizer_states,
            activations,
            buffers,
            states.step_temporaries,
            states.host,
            states.nvme,
            # One process trains without DDP's wrapper (Lightning's single-device strategy): no gradient buckets, and
            # zero_grad sets gradients to None, so each is allocated in backward. Composed from a probe's bytes, the
            # additive total stood above an H200's allocator peak by the gradients' bytes (gpt2-124m at micro 16, 32
            # and 64, llama-1b at micro 8: within 0.3% once they are not added). The formula's constants were fitted
            # to eager peaks with the additive total (test_planner_memory), so it keeps that.
            grads_in_backward=probed and layout.world_size == 1,
        )
        if best is None or candidate.total > best.total:
            best = candidate
    assert best is not None
    return best
