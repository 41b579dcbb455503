"""Memory per GPU: model states, activations, communication/working buffers.

Each strategy's model states are its own (``StrategyTerms.model_states`` in ``planner/terms/<name>.py``: the real
layout that strategy allocates, not one generic formula); activations, the loss's logits and pipeline stages are
shared and live here.

Totals add activations and buffers to model states although gradients grow while activations are freed in
backward: the sum is the conservative peak that DeepSpeed's and Megatron's estimators also use, and the real one
wherever a gradient buffer persists (DDP's buckets, ZeRO's flat buffers). One process without DDP's wrapper
allocates its gradients in backward: composed from a GPU probe's bytes, they take the activations' place there
(``MemoryBreakdown.grads_in_backward``).
"""

from __future__ import annotations

import math

from disttrain.planner.breakdown import MemoryBreakdown
from disttrain.planner.bubble import last_stage_rank, microbatches_in_flight, stages_of_rank
from disttrain.planner.shapes import ModelShape
from disttrain.planner.spec import Layout, Workload

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


def compute_bytes(precision: str) -> int:
    """Bytes per element of matmul inputs/outputs (activations, gathered weights)."""
    return 4 if precision == "fp32" else 2


def residual_bytes(autocast_over_fp32_weights: bool, precision: str) -> int:
    """Bytes per element of the residual stream (norm inputs, block inputs).

    Lightning's mixed precision for DDP is autocast over fp32 weights: the embedding output and residual adds
    stay fp32. FSDP2's bf16 param_dtype, DeepSpeed and Megatron run the whole model in 16 bits.
    """
    mixed_autocast = autocast_over_fp32_weights and precision in ("bf16-mixed", "fp16-mixed")
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
        # A measured module's saved tensors grow with its rows; a raw parameter count has none to measure.
        return (shape.activation_bytes_per_sample or 0.0) * workload.micro_batch_size
    precision = workload.precision
    act, res = compute_bytes(precision), residual_bytes(layout.terms.autocast_over_fp32_weights, precision)
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


def autocast_copy_bytes(shape: ModelShape, precision: str) -> int:
    """Autocast's 16-bit copies of the linear weights over fp32 parameters, alive from forward to backward."""
    return 2 * shape.linear_parameters if precision in ("bf16-mixed", "fp16-mixed") else 0


def model_state_bytes(shape: ModelShape, layout: Layout, workload: Workload, stage: int = 0) -> MemoryBreakdown:
    """Parameters, gradients, optimizer states and strategy buffers on one GPU (activations left at 0)."""
    return layout.terms.model_states(shape, layout, workload, stage)


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
        probed = measured is not None and layout.recompute == "none" and layout.terms.autocast_over_fp32_weights
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
