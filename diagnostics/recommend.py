"""Findings -> ranked recommendations, each a concrete Hydra override of this project's config (conf/).

Values are computed from the run's own config (``run.json``) so an override always differs from what ran and
stays legal (divisibility of the global batch, options that exist for the current strategy and device). A
finding without a config lever (a slow host, a hot GPU, a hang) says so in ``why`` and has no override.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from diagnostics.analysis import Analysis, Finding
from diagnostics.analysis.comm_split import strategy_split
from diagnostics.analysis.context import RunContext, hydra_value
from diagnostics.analysis.finding import pct
from diagnostics.analysis.pauses import INTERVAL_KEYS
from diagnostics.analysis.thresholds import (
    AMORTIZED_MIN,
    PAUSE_TARGET_SHARE,
    PLACEMENT_MIN_CUT,
    TOKENS_MATERIAL,
    TP_MATERIAL,
)

# DataLoader workers beyond ~8 per rank rarely help (each is a process with its own copy of the dataset) and
# cost host memory; the target is the cores each rank has, at least 2 so that one batch loads while one waits.
MAX_WORKERS_PER_RANK = 8
MIN_WORKERS = 2
# When the training host's core count is unknown: GPU nodes have cores to spare; on a CPU run the training
# processes themselves use the cores, so fewer loader processes.
DEFAULT_GPU_WORKERS = 4
# Per-step logging syncs the loss across ranks; every 10 steps makes that cost negligible.
LOG_EVERY_N_STEPS = 10


NOT_ESTIMATED = {"fraction": 0.0, "basis": "not estimated from this run's telemetry"}


def gain(finding: Finding, share: float, basis: str) -> dict[str, Any]:
    """Expected gain: ``share`` of the finding's cost (a share of the step time), and how it was estimated."""
    return {"fraction": round(min(1.0, max(0.0, share * finding.cost_fraction)), 4), "basis": basis}


@dataclass(frozen=True)
class Recommendation:
    """``key=value`` is the change to try; ``pinned`` overrides keep everything else equal to the original.

    ``expected_gain``: the share of the step time it should save ({"fraction", "basis"}), from the finding's cost.
    """

    key: str | None
    value: str | None
    why: str
    expected_effect: str
    pinned: tuple[str, ...] = ()
    expected_gain: dict[str, Any] = field(default_factory=lambda: dict(NOT_ESTIMATED), compare=False)
    # ``diagnose --ab`` compares step times; a lever against non-finite values changes whether a run survives,
    # which two short runs cannot show, so it is not offered for A/B.
    ab_testable: bool = True
    # What its A/B compares: the training steps' tokens/s, or ``loop_tokens_per_s`` (the loop's wall-clock rate,
    # validation and checkpoint writes included) for a lever that changes time outside the steps.
    metric: str = "tokens_per_s"

    @property
    def gain_estimated(self) -> bool:
        """False where nothing in the run's telemetry sized the gain: its 0 is "unknown", not "nothing"."""
        return self.expected_gain.get("basis") != NOT_ESTIMATED["basis"]

    @property
    def override(self) -> str:
        """The override(s) to add to the original command; empty when no config lever exists."""
        if self.key is None:
            return ""
        return " ".join([*self.pinned, f"{self.key}={self.value}"])

    def to_json(self) -> dict[str, Any]:
        return {
            "override": self.override,
            "why": self.why,
            "expected_effect": self.expected_effect,
            "expected_gain": self.expected_gain,
        }

    def gaining(self, expected: dict[str, Any]) -> Recommendation:
        return replace(self, expected_gain=expected)


def _rec(key: str | None, value: Any, why: str, effect: str, pinned: tuple[str, ...] = ()) -> Recommendation:
    return Recommendation(key, None if key is None else hydra_value(value), why, effect, pinned)


def _no_lever(why: str, effect: str) -> Recommendation:
    return Recommendation(None, None, f"No config lever: {why}", effect)


# What each lever is expected to recover of its finding's cost, and why (keyed by override key, or value).
ALL_OF_IT = 1.0
HALF = 0.5


def _kept_global(ctx: RunContext) -> tuple[str, ...]:
    return (f"trainer.global_batch_size={ctx.global_batch()}",) if ctx.global_batch() else ()


def _bigger_global(ctx: RunContext, why: str, effect: str) -> list[Recommendation]:
    current = ctx.global_batch()
    if not current:
        return []
    # Doubling keeps it a multiple of micro x dp; accumulation doubles, so the optimizer sees twice the tokens.
    return [_rec("trainer.global_batch_size", 2 * current, why, effect)]


def _smaller_micro(ctx: RunContext) -> list[Recommendation]:
    micro = ctx.micro() or 0
    divisors = [d for d in range(micro - 1, 0, -1) if micro % d == 0] if micro and micro > 1 else []
    if not divisors or not ctx.global_batch():
        return []
    # A divisor of micro keeps the global batch a multiple of micro x dp: same optimization, more accumulation.
    return [
        _rec(
            "trainer.micro_batch_size",
            divisors[0],
            f"activations scale with the micro batch; {divisors[0]} instead of {micro} with the global batch kept at "
            f"{ctx.global_batch()} (more accumulation) leaves the optimization unchanged",
            f"activation memory about {divisors[0] / micro:.0%} of now; slightly lower throughput",
            _kept_global(ctx),
        )
    ]


def _larger_micro(ctx: RunContext) -> list[Recommendation]:
    micro, keep = ctx.micro(), (ctx.batch.get("accumulation") or 1) % 2 == 0
    if not micro:
        return []
    # With even accumulation the global batch can stay (half the accumulation); otherwise it doubles too.
    batch = f"the global batch stays {ctx.global_batch()}" if keep else "the global batch doubles with it (retune lr)"
    why = f"bigger matmuls per launch amortize per-step overhead; {batch}"
    return [
        _rec(
            "trainer.micro_batch_size",
            2 * micro,
            why,
            "higher device efficiency if memory allows",
            _kept_global(ctx) if keep else (),
        )
    ]


def share_hidden_by_workers(wait: float, current: int, workers: int) -> float:
    """The share of a data wait (``wait``: its share of the step) that ``workers`` loader processes per rank hide.

    Loading in the training process (``current`` 0) is serial: a batch takes the whole wait to load. With ``current``
    workers the loader delivers a batch per step, so each worker takes ``current`` steps per batch. ``workers``
    deliver one every load / workers, overlapped with the rest of the step: what remains of the wait is
    load / workers - rest (none once the workers keep up). A 0.3 s loader under a 0.03 s step (wait 0.91): two
    workers leave 0.12 s of it, the step 0.15 s instead of 0.33 s, +120% tokens/s, not the whole wait's +1000%."""
    if wait <= 0:
        return 0.0
    rest = 1.0 - wait
    load = wait if current == 0 else float(current)  # one batch's loading, in steps
    left = max(0.0, load / workers - rest)
    return max(0.0, min(1.0, (wait - left) / wait))


def for_input_bound(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    key = "data.num_workers" if ctx.has("data.num_workers") or not ctx.config else "+data.num_workers"
    current = ctx.get("data.num_workers") or 0
    target = DEFAULT_GPU_WORKERS if ctx.on_gpu else MIN_WORKERS
    if ctx.cpu_count:
        target = min(MAX_WORKERS_PER_RANK, max(MIN_WORKERS, ctx.cpu_count // ctx.local_ranks()))
    workers = max(target, 2 * current)
    wait = max(finding.evidence.get("data_wait_fraction", {0: 0.0}).values())
    now = "in the training process" if current == 0 else f"by {current} worker(s) per rank"
    why = f"batches are produced {now}; {workers} workers per rank load ahead while the current batch trains"
    if not key.startswith("data."):
        why += " (passed to your datamodule's constructor)"
    share = share_hidden_by_workers(finding.cost_fraction, current, workers)
    basis = (
        f"the slowest rank's data wait as far as {workers} workers per rank keep up: each loads a batch in the time "
        f"the training process did{'' if current == 0 else f' with {current} worker(s)'}, overlapped with the rest "
        "of the step"
    )
    hidden = gain(finding, share, basis)
    recs = [_rec(key, workers, why, f"up to {wait:.0%} shorter steps if loading parallelizes").gaining(hidden)]
    if ctx.on_gpu and ctx.get("data.pin_memory") is False:
        why = "page-locked host batches copy to the GPU asynchronously"
        recs.append(_rec("data.pin_memory", True, why, "hides the host-to-device copy"))
    if ctx.get("data.name") == "custom" or not ctx.has("data.num_workers"):
        note = _no_lever("profile your datamodule's __getitem__/collate; the loader cannot be faster", "-")
        recs.append(note.gaining(gain(finding, ALL_OF_IT, "the data wait, once batches are produced in time")))
    return recs


# Where to look, by the phase a rank is slow in.
SLOW_PHASE_HINTS = {
    "forward": "its compute (other processes: top / nvidia-smi, clocks and temperature: nvidia-smi -q -d "
    "PERFORMANCE, CPU/NUMA binding) or rank-dependent work in the model's forward",
    "backward": "its compute (other processes, clocks, CPU/NUMA binding) or rank-dependent work in backward hooks",
    "optimizer": "its optimizer step (CPU offload, gradient clipping or hooks that run on this rank only)",
    "other": "work between steps on this rank only: logging, checkpoint writes, callbacks, rank-0-only hooks",
}


def for_straggler(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    slow = finding.evidence.get("slow_phase_by_rank") or {}
    rank = max(finding.ranks, key=lambda r: (finding.evidence.get("falls_behind_s_per_step") or {}).get(r, 0.0))
    host = (finding.evidence.get("hostnames") or {}).get(rank)
    phase = slow.get(rank) or finding.evidence.get("slow_phase") or "forward"
    where = f"rank {rank}" + (f" on host {host}" if host else "")
    why = (
        f"{where} is slow in {phase} while the others wait for it; check {SLOW_PHASE_HINTS.get(phase, phase)}, and "
        "exclude a slow host (sbatch --exclude) if it stays slow"
    )
    expected = gain(finding, ALL_OF_IT, "the time the others wait for it per step")
    return [_no_lever(why, "every rank at the others' pace").gaining(expected)]


# PowerSGD's default rank and warm-up (conf/strategy/ddp.yaml); a matrix below this width compresses < 8x.
POWERSGD_RANK = 4
POWERSGD_WARMUP_STEPS = 50
POWERSGD_MIN_WIDTH = 64


def _onebit_adam(ctx: RunContext) -> bool:
    """Whether the run is 1-bit Adam's: after its warm-up the momentum crosses the wire inside the optimizer step,
    compressed already, and DDP's buckets carry nothing (hooks, bucket sizes and other strategies do not apply)."""
    return ctx.get("optimizer.name") == "onebit_adam"


def _ddp_comm_hooks(ctx: RunContext, finding: Finding) -> list[Recommendation]:
    """DDP comm hooks that send fewer bytes than the run did (strategy.comm_hook), smallest change first."""
    if _onebit_adam(ctx):
        return []
    hook = ctx.get("strategy.comm_hook") or "none"
    recs: list[Recommendation] = []
    if hook == "none" and ctx.get("precision.name") != "bf16-true":  # bf16-true gradients are 2 bytes already
        why = "gradients are all-reduced in fp32; a bf16 copy of each bucket keeps fp32's range at half the size"
        half = gain(finding, HALF, "half the bytes: half of the exposed communication time (bandwidth-bound)")
        recs.append(_rec("strategy.comm_hook", "bf16", why, "half the gradient all-reduce bytes").gaining(half))
    width = ctx.get("model.d_model")
    max_steps = ctx.get("trainer.max_steps")
    if hook != "powersgd" and (not isinstance(width, int) or width >= POWERSGD_MIN_WIDTH):
        shape = f"a {width}x{width} gradient" if isinstance(width, int) else "an n x m gradient"
        ratio = f"{width / (2 * POWERSGD_RANK):.0f}x" if isinstance(width, int) else "min(n, m)/8 x"
        why = (
            f"PowerSGD sends rank-{POWERSGD_RANK} factors of each weight matrix: {shape} becomes "
            f"(rows + cols) x {POWERSGD_RANK} values, {ratio} fewer; biases and norms go uncompressed, and error "
            "feedback keeps convergence close to plain all-reduce"
        )
        pinned: tuple[str, ...] = ()
        if isinstance(max_steps, int) and max_steps <= POWERSGD_WARMUP_STEPS:
            if max_steps <= 2:
                return recs  # no step would be left after PowerSGD's shortest warm-up
            pinned = (f"strategy.powersgd_warmup_steps={max(2, max_steps // 10)}",)
        effect = "gradient bytes cut by about the ratio above after the warm-up; check the loss curve"
        most = gain(finding, 0.8, "most of the exposed communication; compression costs compute on both ends")
        recs.append(_rec("strategy.comm_hook", "powersgd", why, effect, pinned).gaining(most))
    if hook == "none" and ctx.get("optimizer.name") == "adamw":
        why = (
            "1-bit Adam exchanges the momentum instead of the gradients, as signs with one scale per 512 values "
            "(~1/30 of fp32's bytes), after a warm-up of plain AdamW; error feedback keeps what compression loses"
        )
        effect = "gradient traffic cut ~30x after the freeze; the optimizer changes: check the loss curve"
        measured = "an emulated 40 MB/s link: 143 of its 183 ms exposed a step gone, 1.26x tokens/s (RESULTS.md)"
        most = gain(finding, 0.8, f"most of the exposed communication, as on {measured}")
        recs.append(_rec("optimizer", "onebit_adam", why, effect).gaining(most))
    rank = ctx.get("strategy.powersgd_rank")
    if hook == "powersgd" and isinstance(rank, int) and rank > 1:
        why = f"the P and Q factors grow with the rank: rank {rank // 2} sends half of what rank {rank} does"
        effect = "half the compressed bytes; a coarser gradient"
        half = gain(finding, HALF, "half of the compressed bytes' exposed time")
        recs.append(_rec("strategy.powersgd_rank", rank // 2, why, effect).gaining(half))
    return recs


def _comm_split(finding: Finding, ctx: RunContext) -> dict[str, Any]:
    """The finding's split of the communication by lever, else the strategy's (an older report: none recorded)."""
    return finding.evidence.get("comm_split") or strategy_split(ctx) or {}


def _tensor_parallel_levers(finding: Finding, ctx: RunContext, split: dict[str, Any]) -> list[Recommendation]:
    """strategy=megatron with tp >= 2: tensor parallelism's activation collectives (``tp_share`` of the
    communication) repeat every micro-batch, so accumulation and the reduction dtype leave them as they are. Halving
    tp cuts each all-reduce's bytes from 2(tp-1)/tp of the activation to 2(tp/2-1)/(tp/2) (to none at tp=2); the
    freed ranks double the data parallelism, whose once-per-step gradient reduction is not counted. The micro-batch
    halves as dp doubles, so the global batch stays. The DTensor modules' host dispatch, which tp=1 also removes, is
    not added: on gpt-nano tp=2 (2 CPU ranks) the exposed communication alone expected +30%, --ab measured +30.7%,
    and adding the planner's dispatch share (14%) expected +58%."""
    tp_share = float(split.get("tensor_parallel") or 0.0)
    tp, micro, current = ctx.get("strategy.tp"), ctx.micro(), ctx.global_batch()
    if not isinstance(tp, int) or tp < 2 or not micro or micro % 2 or not current or tp_share < TP_MATERIAL:
        return []
    half = tp // 2
    kept = 1.0 - ((half - 1) / half) / ((tp - 1) / tp)
    dp = ctx.batch.get("data_parallel_size")
    moved = "no gradients move" if dp == 1 else f"gradients move once per step, {pct(1.0 - tp_share)} at most"
    why = (
        f"tp={tp}'s activation all-reduces are {pct(tp_share)} of the communication and repeat every micro-batch "
        f"({moved}); at tp={half} each moves "
        + ("nothing" if half == 1 else f"{kept:.0%} fewer bytes")
        + f", and the freed ranks train data-parallel (micro-batch {micro // 2}, the same global batch)"
    )
    effect = "less activation communication per token; a once-per-step gradient reduction between the new dp ranks"
    basis = (
        f"tp's {pct(tp_share)} of the communication x all-reduce bytes 2(tp-1)/tp: {pct(kept)} of them gone at "
        f"tp={half}; the added gradient reduction not counted"
    )
    pinned = (f"trainer.micro_batch_size={micro // 2}", f"trainer.global_batch_size={current}")
    return [_rec("strategy.tp", half, why, effect, pinned).gaining(gain(finding, kept * tp_share, basis))]


def for_comm_bound(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    """Each lever by the part of the communication it shrinks (``comm_split``): accumulation the part that moves
    once per optimizer step, a smaller tp tensor parallelism's, a smaller ep the all-to-alls'."""
    split = _comm_split(finding, ctx)
    recs: list[Recommendation] = []
    if ctx.strategy == "megatron":
        recs += _tensor_parallel_levers(finding, ctx, split)
    # An MoE run's all-to-alls move every micro-batch's tokens (measured where they were timed).
    exchange = finding.evidence.get("all_to_all") or {}
    tokens = float(exchange.get("of_phase_transfer") or 0.0)
    recs += _expert_exchange_levers(finding, ctx, exchange)
    # Without a split (a strategy whose schedule needs shapes the run did not record): gradients assumed.
    once = split.get("once_per_step")
    amortized = min(1.0 if once is None else float(once), 1.0 - tokens)
    if amortized >= AMORTIZED_MIN:
        what = "the gradients' reduction" if once is None else f"{pct(amortized)} of the communication"
        why = f"{what} moves once per optimizer step; twice the accumulation halves it per token"
        effect = "communication per token falls (the batch doubles: retune lr if needed)"
        basis = f"one step's once-only traffic ({pct(amortized)} of it) spread over twice the tokens"
        if split.get("basis"):
            basis += f"; the split from {split['basis']}"
        per_token = gain(finding, HALF * amortized, basis)
        recs += [r.gaining(per_token) for r in _bigger_global(ctx, why, effect)]
    precision = ctx.get("precision.name")
    busy = bool(ctx.host_cores_busy())
    if ctx.strategy == "ddp" and _onebit_adam(ctx):
        why = (
            "1-bit Adam already sends ~1/30 of the gradient bytes, from the optimizer step where no compute hides "
            "them; what is left is the exchange's own time"
        )
        recs.append(_no_lever(why, "a bigger global batch (above) spreads the exchange over more tokens"))
    elif ctx.strategy == "ddp":
        recs += _ddp_comm_hooks(ctx, finding)
        bucket = ctx.get("strategy.bucket_cap_mb") or 25
        why = f"fewer, larger all-reduces than {bucket} MB buckets pay the collective latency fewer times"
        recs.append(_rec("strategy.bucket_cap_mb", 4 * bucket, why, "less exposed communication if latency-bound"))
        # Moving communication behind compute needs a free core (or a GPU) to run it on.
        if precision != "fp16-mixed" and not busy:  # FSDP2 here takes fp32 and bf16 policies only
            why = (
                "FSDP reduce-scatters gradients per block during backward (in bf16 if asked); it moves 1.5x DDP's "
                "bytes, so it pays when overlap, not bandwidth, is the limit"
            )
            recs.append(_rec("strategy", "fsdp", why, "more communication hidden behind compute"))
    elif ctx.strategy == "fsdp":
        if precision in ("bf16-mixed", "bf16-true") and ctx.get("strategy.reduce_dtype") == "fp32":
            reduced = min(float(split.get("gradient_reduction", 1.0)), 1.0 - tokens)
            why = f"reduce-scatter gradients in bf16 instead of fp32 ({pct(reduced)} of the communication)"
            basis = f"half the gradient bytes: half of the reduce-scatters' {pct(reduced)} of the communication"
            half = gain(finding, HALF * reduced, basis)
            recs.append(_rec("strategy.reduce_dtype", "bf16", why, "half the gradient bytes").gaining(half))
        if ctx.get("strategy.reshard_after_forward") is True:
            why = "keep gathered parameters from forward to backward: one all-gather per block instead of two"
            rec = _rec("strategy.reshard_after_forward", False, why, "a third less traffic, more memory")
            if "gradient_reduction" in split:
                # What is not gradient reduction (or tokens) is the blocks' all-gathers, forward's and backward's
                # alike: backward's half of them goes.
                gathers = max(0.0, 1.0 - float(split["gradient_reduction"]) - tokens)
                basis = f"backward's all-gathers: half of the all-gathers' {pct(gathers)} of the communication"
                rec = rec.gaining(gain(finding, HALF * gathers, basis))
            recs.append(rec)
    elif ctx.zero3 and "gradient_reduction" in split:
        recs += zero2_lever(finding, ctx, split, tokens)
    return recs


def zero2_lever(finding: Finding, ctx: RunContext, split: dict[str, Any], tokens: float) -> list[Recommendation]:
    """ZeRO-3 gathers each module's parameters before its forward and again before its backward, every micro-batch
    (and its small "persistent" parameters after every step); ZeRO-2 keeps whole parameters and gathers the updated
    ones once per step. Costed on bytes: the gathers less the one ZeRO-2 keeps, 1/(2 x micro-batches) of them: a
    lower bound. ZeRO-3's many small calls and its per-module hooks cost host time beyond the collectives' (4 CPU
    ranks, default model: expected +17% tokens/s, --ab measured +115%, 95% CI +99..+132%). Not offered where the
    devices' measured headroom cannot hold the whole parameters (ZeRO-3 is often there because they do not fit)."""
    ev = finding.evidence
    dp = int(ctx.batch.get("data_parallel_size") or 1)
    precision = str(ctx.get("precision.name") or "fp32")
    width = 2 if precision.startswith(("bf16", "fp16")) else 4
    headroom, params = ev.get("device_headroom_bytes"), ev.get("num_parameters")
    if isinstance(headroom, int | float) and isinstance(params, int) and width * params * (1 - 1 / dp) > headroom:
        return []
    gathers = max(0.0, 1.0 - float(split["gradient_reduction"]) - tokens)
    micro_batches = int(ctx.batch.get("accumulation") or 1)
    saved = gathers * (1.0 - 1.0 / (2 * micro_batches))
    why = (
        f"ZeRO-3's all-gathers ({pct(gathers)} of the communication) fetch every module's parameters before its "
        "forward and again before its backward, every micro-batch; ZeRO-2 keeps whole parameters on every rank and "
        "gathers the updated ones once per step"
    )
    effect = "fewer and larger all-gathers; each rank holds whole parameters instead of a 1/dp shard"
    basis = (
        f"the all-gathers' {pct(gathers)} of the communication less the once-per-step gather ZeRO-2 keeps "
        f"(1/(2 x {micro_batches}) of their bytes); a lower bound: ZeRO-3's per-module hooks are not counted"
    )
    return [_rec("strategy.stage", 2, why, effect).gaining(gain(finding, saved, basis))]


def _expert_exchange_levers(finding: Finding, ctx: RunContext, exchange: dict[str, Any]) -> list[Recommendation]:
    """Expert parallelism whose all-to-alls take a material share of the step: fewer ranks per expert group.

    Halving ep from N, each rank sends (1 - 2/N) of its tokens away instead of (1 - 1/N): 1/(N-1) less token
    traffic (all of it at N=2), and the all-to-alls' waits go with their calls.
    """
    ep = ctx.get("strategy.ep")
    share = float(exchange.get("share") or 0.0)
    if share < TOKENS_MATERIAL or not isinstance(ep, int) or ep < 2:
        return []
    tokens = float(exchange.get("of_phase_transfer") or 0.0)
    why = (
        f"the expert all-to-alls take {pct(share)} of the step ({pct(tokens)} of the phases' transfer) and move "
        f"tokens among ep={ep} ranks; with ep={ep // 2} each rank holds twice the experts, "
        + ("exchanges no tokens, " if ep == 2 else f"exchanges tokens among {ep // 2} ranks, ")
        + "and the experts' gradients join the data-parallel reduction, once per optimizer step"
    )
    effect = "token traffic halved or gone; more expert memory per rank and more gradient traffic"
    saved = share / (ep - 1)
    basis = (
        f"the all-to-alls' {pct(share)} of the step x 1/(ep-1) = {pct(saved)} (token traffic at ep={ep // 2}); "
        "the experts' added gradient traffic is not counted"
    )
    expected = {"fraction": round(min(finding.cost_fraction, saved), 4), "basis": basis}
    return [_rec("strategy.ep", ep // 2, why, effect).gaining(expected)]


def _nothing_to_overlap_with(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    """A CPU host whose compute threads fill every core: overlap cannot help, fewer bytes can."""
    threads = f"{ctx.num_threads} thread(s)" if ctx.num_threads else "the default threads"
    ranks = ctx.ranks_per_host or ctx.local_ranks()
    why = (
        f"{ranks} rank(s) x {threads} already occupy all {ctx.cpu_count} cores of the host, so communication "
        "started earlier (smaller buckets, prefetching) would only take cores from the compute; sending fewer "
        "bytes is what shortens it"
    )
    recs = _ddp_comm_hooks(ctx, finding) if ctx.strategy == "ddp" else []
    if ctx.strategy == "megatron":
        recs += _tensor_parallel_levers(finding, ctx, _comm_split(finding, ctx))
    return [*recs, _no_lever(why, "overlap gains nothing on this host")]


def for_low_overlap(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    if finding.evidence.get("host_cores_busy") or ctx.host_cores_busy():
        return _nothing_to_overlap_with(finding, ctx)
    hidden = gain(finding, ALL_OF_IT, "the exposed communication, hidden behind backward compute")
    return [r.gaining(hidden) if r.key else r for r in _overlap_levers(ctx)]


def _overlap_levers(ctx: RunContext) -> list[Recommendation]:
    if ctx.strategy == "ddp" and _onebit_adam(ctx):
        why = "1-bit Adam's exchange runs inside the optimizer step, after backward: no bucket size moves it"
        return [_no_lever(why, "a bigger global batch spreads it over more tokens")]
    if ctx.strategy == "ddp":
        bucket = ctx.get("strategy.bucket_cap_mb") or 25
        smaller = max(1, bucket // 4)
        why = (
            f"a bucket is all-reduced only when full: with {bucket} MB buckets a small model fills one bucket at the "
            f"very end of backward; {smaller} MB buckets start reducing while backward still runs"
        )
        return [_rec("strategy.bucket_cap_mb", smaller, why, "communication overlapped with backward, not after it")]
    if ctx.strategy == "fsdp" and ctx.get("strategy.reshard_after_forward") is True:
        why = "backward then needs no all-gathers of its own, so only reduce-scatters remain to overlap"
        return [_rec("strategy.reshard_after_forward", False, why, "shorter backward critical path, more memory")]
    if ctx.strategy == "deepspeed":
        if ctx.get("strategy.overlap_comm") is False:
            why = "DeepSpeed reduces gradient buckets only after backward unless overlap_comm is on"
            return [_rec("strategy.overlap_comm", True, why, "gradient reduction overlapped with backward")]
        bucket = ctx.get("strategy.reduce_bucket_size") or 200_000_000
        why = (
            f"a gradient bucket is reduced only when {bucket:,} elements are ready: a smaller bucket starts "
            "reducing while backward still runs"
        )
        return [_rec("strategy.reduce_bucket_size", max(1, bucket // 4), why, "communication overlapped with backward")]
    tp = ctx.get("strategy.tp")
    if ctx.strategy == "megatron" and isinstance(tp, int) and tp > 1:
        why = (
            f"tensor parallelism all-reduces (or gathers and scatters) activations inside every layer, on the "
            f"critical path: tp={tp // 2} halves those collectives (the freed ranks join data parallelism)"
        )
        return [_rec("strategy.tp", tp // 2, why, "fewer exposed collectives per layer, more memory per rank")]
    if ctx.strategy == "megatron":
        why = "the unhidden collectives are FSDP2's on the data-parallel axis, which prefetches as far as it can"
        return [_no_lever(why, "see the per-op communication in the evidence")]
    return []


def for_memory_pressure(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    headroom = {"fraction": 0.0, "basis": "memory headroom, not speed: these levers trade some step time for memory"}
    return [r.gaining(headroom) for r in _memory_levers(ctx)]


def _memory_levers(ctx: RunContext) -> list[Recommendation]:
    recs: list[Recommendation] = []
    if ctx.strategy == "fsdp" and ctx.get("strategy.activation_checkpointing") is False:
        why = "recompute each block's activations in backward instead of keeping them"
        effect = "activation memory drops to about one block's worth; ~1/3 more compute (HFU > MFU)"
        recs.append(_rec("strategy.activation_checkpointing", True, why, effect))
    recs += _smaller_micro(ctx)
    if ctx.strategy == "ddp" and ctx.get("precision.name") != "fp16-mixed":
        why = "DDP keeps full parameters, gradients and optimizer states on every rank; FSDP shards them over dp"
        recs.append(_rec("strategy", "fsdp", why, "parameter + optimizer memory per rank divided by the dp size"))
    if ctx.strategy == "ddp":
        why = "ZeRO-2 (the default stage) shards gradients and optimizer states over dp; compute stays as in DDP"
        recs.append(_rec("strategy", "deepspeed", why, "gradient + optimizer memory per rank divided by the dp size"))
    recs += _deepspeed_memory(ctx)
    if ctx.get("precision.name") == "fp32":
        recs.append(_rec("precision", "bf16-mixed", "bf16 activations take half the memory", "less activation memory"))
    if ctx.strategy == "fsdp" and ctx.on_gpu and ctx.get("strategy.cpu_offload") is False:
        why = "last resort: sharded parameters and optimizer states live in host memory"
        recs.append(_rec("strategy.cpu_offload", True, why, "much less GPU memory, much slower steps"))
    return recs


def _deepspeed_memory(ctx: RunContext) -> list[Recommendation]:
    """ZeRO's memory levers, cheapest first: recomputation, the next stage, then (GPU only) host offload."""
    if ctx.strategy != "deepspeed":
        return []
    recs: list[Recommendation] = []
    if ctx.get("strategy.activation_checkpointing") is False:
        why = "recompute each block's activations in backward instead of keeping them"
        effect = "activation memory drops to about one block's worth; ~1/3 more compute (HFU > MFU)"
        recs.append(_rec("strategy.activation_checkpointing", True, why, effect))
    stage = ctx.get("strategy.stage")
    if stage in (1, 2):
        what = {1: "gradients", 2: "parameters"}[stage]
        why = f"ZeRO-{stage + 1} also shards the {what} over the data-parallel ranks"
        recs.append(_rec("strategy.stage", stage + 1, why, f"{what} memory per rank divided by the dp size"))
    if ctx.on_gpu and ctx.get("strategy.offload_optimizer") is False:
        why = "last resort: optimizer states live in host memory and the host steps them"
        recs.append(_rec("strategy.offload_optimizer", True, why, "much less GPU memory, slower steps"))
    return recs


def _compile(ctx: RunContext) -> list[Recommendation]:
    if ctx.get("model.compile") is True:
        return _cuda_graphs(ctx)
    if ctx.get("model.compile") is not False:
        return []
    why = "torch.compile fuses small ops: fewer kernel launches and Python calls per step"
    return [_rec("model.compile", True, why, "less host overhead, higher achieved FLOP/s")]


def _cuda_graphs(ctx: RunContext) -> list[Recommendation]:
    """Compiled blocks still launched kernel by kernel: CUDA graphs replay each block in one launch (DDP, dense
    models: what the config accepts). On an H200, gpt2-124m at micro-batch 16 stepped in 36.9 ms with them against
    44.1 ms without (GPU busy 96% against 52%)."""
    if not ctx.on_gpu or ctx.get("strategy.name") != "ddp" or (ctx.get("model.num_experts") or 0) > 0:
        return []
    if not ctx.has("model.compile_mode"):  # a model=hf or user model: compiled whole, no mode key to set
        return []
    if ctx.get("model.compile_mode") in ("reduce-overhead", "max-autotune"):
        return []
    why = "CUDA graphs replay each compiled block's kernels in one launch instead of launching them one by one"
    return [_rec("model.compile_mode", "reduce-overhead", why, "less host time per step on a launch-bound GPU")]


def _outside_phases(finding: Finding) -> bool:
    """Whether host_overhead's excess is time outside every timed phase (the step loop's own Python: hooks,
    logging, the optimizer call), which compile cannot touch, rather than idle gaps inside forward/backward."""
    ev = finding.evidence
    outside = ev.get("unattributed_fraction") or {}
    return max((float(v or 0.0) for v in outside.values()), default=0.0) >= float(ev.get("threshold_fraction") or 1.0)


def for_host_overhead(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    amortized = gain(finding, HALF, "the per-step overhead spread over twice the tokens")
    larger = [r.gaining(amortized) for r in _larger_micro(ctx)]
    # Outside the phases, more tokens per step amortize it: a 2-layer 32-wide model on 2 CPU ranks, 10.5% outside
    # the phases: micro-batch 8 measured +75% tokens/s (3 interleaved rounds, CI +32..+133%), compile -2.9% (CI
    # -29..+33%). Inside them, compile removes the gaps between small ops.
    recs = larger + _compile(ctx) if _outside_phases(finding) else _compile(ctx) + larger
    every = ctx.get("trainer.log_every_n_steps")
    if isinstance(every, int) and every < LOG_EVERY_N_STEPS:
        why = f"logging every {every} step(s) syncs the loss across ranks each time"
        recs.append(_rec("trainer.log_every_n_steps", LOG_EVERY_N_STEPS, why, "one host sync every 10 steps"))
    return recs


PAUSE_NAMES = {"validation": "validations", "checkpoint": "checkpoint writes"}
PAUSE_TRADE_OFFS = {
    "validation": "a validation loss every {n} steps instead of every {old}",
    "checkpoint": "a crash or preemption loses up to {n} steps of work instead of {old}",
}


def periodic_count(every: int, max_steps: int) -> int:
    """Pauses due before the last step (the one at the last step comes whatever the interval)."""
    return (max_steps - 1) // every if every > 0 else 0


def for_pauses(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    """Each kind of pause made rarer, most costly first: its interval multiplied until its share is about
    PAUSE_TARGET_SHARE (but one still comes before the last step); the gain is the share of its pauses that no
    longer come in the run's steps."""
    shares = finding.evidence.get("share_by_what") or {}
    max_steps = ctx.get("trainer.max_steps")
    recs: list[Recommendation] = []
    for what, share in sorted(shares.items(), key=lambda item: -float(item[1] or 0.0)):
        key, share = INTERVAL_KEYS.get(what), float(share or 0.0)
        if share <= PAUSE_TARGET_SHARE:
            continue
        every = ctx.get(key) if key else None
        periodic = isinstance(every, int) and isinstance(max_steps, int) and periodic_count(every, max_steps) > 0
        if key is None or not isinstance(every, int) or not isinstance(max_steps, int) or not periodic:
            # Pauses no interval of the run's config makes periodic (a signal's checkpoints, a user callback's saves).
            shown = f"{key}={every}" if key and every is not None else "no interval in the run's config"
            recs.append(_no_lever(f"{PAUSE_NAMES.get(what, what)} take {pct(share)} of the loop ({shown})", "-"))
            continue
        before = periodic_count(every, max_steps)
        # At most as rare as keeps one of them inside the run: a run validates or saves for a reason.
        factor = max(2, min(math.ceil(share / PAUSE_TARGET_SHARE), before))
        rarer, after = every * factor, periodic_count(every * factor, max_steps)
        saved = 1.0 - after / before
        why = (
            f"{PAUSE_NAMES.get(what, what)} take {pct(share)} of the training loop, every {every} steps; every "
            f"{rarer} steps they come {factor}x less often"
        )
        trade_off = PAUSE_TRADE_OFFS.get(what, "{n} steps apart instead of {old}").format(n=rarer, old=every)
        effect = f"{pct(share * saved)} less wall-clock time for the same steps; {trade_off}"
        basis = f"the {what} pauses that no longer come: {before} -> {after} in the run"
        rec = replace(_rec(key, rarer, why, effect), metric="loop_tokens_per_s")
        recs.append(rec.gaining(gain(finding, share * saved / (finding.cost_fraction or 1.0), basis)))
    return recs


def for_low_mfu(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    recs: list[Recommendation] = []
    if ctx.on_gpu and ctx.get("precision.name") == "fp32":
        why = "fp32 matmuls run far below the tensor-core bf16 peak that MFU is measured against"
        recs.append(_rec("precision", "bf16-mixed", why, "several times the matmul throughput"))
    return recs + _compile(ctx) + _larger_micro(ctx)


def for_pipeline_bubble(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    recs: list[Recommendation] = []
    pp, m, micro = ctx.get("strategy.pp"), ctx.get("strategy.microbatches"), ctx.micro()
    if ctx.strategy == "megatron" and isinstance(pp, int) and pp > 1:
        m = m if isinstance(m, int) else pp
        if micro and micro % 2 == 0:
            why = (
                f"the same global batch in twice the micro-batches (m={2 * m}) halves the bubble, (pp-1)/(m+pp-1) of "
                "the step, with the same optimizer batch"
            )
            pinned = (f"trainer.micro_batch_size={micro // 2}", *_kept_global(ctx))
            rec = _rec("strategy.microbatches", 2 * m, why, "about half the idle share per step", pinned)
            recs.append(rec.gaining(_bubble_gain(finding, pp, 2 * m)))
        layers = ctx.get("model.n_layers")
        interleavable = isinstance(layers, int) and layers % (2 * pp) == 0 and m % pp == 0
        if ctx.get("strategy.schedule") in ("gpipe", "1f1b") and interleavable:
            why = "two model chunks per pipeline rank (interleaved 1F1B) divide the bubble by two at the same batch"
            effect = "half the bubble, for twice the stage-to-stage messages"
            rec = _rec("strategy.schedule", "interleaved_1f1b", why, effect, ("strategy.virtual_stages=2",))
            recs.append(rec.gaining(gain(finding, HALF, "two chunks per rank halve the bubble")))
    why = "more microbatches per step shrink the schedule's bubble, (pp-1)/(m+pp-1) of the step"
    bigger = _bigger_global(ctx, why, "smaller idle share per step")
    if isinstance(pp, int) and pp > 1 and isinstance(m, int):
        bigger = [r.gaining(_bubble_gain(finding, pp, 2 * m)) for r in bigger]
    return recs + bigger


def _bubble_gain(finding: Finding, pp: int, m: int) -> dict[str, Any]:
    """The measured bubble scaled by how the schedule's bubble, (pp-1)/(m+pp-1), shrinks from m/2 to ``m``
    micro-batches. A ratio, not the formula's value: interleaved and zero-bubble schedules measure far below the
    1F1B formula (zero-bubble pp=2, m=2: 12-15% against its 33%), and a stage that idles for other reasons (uneven
    stages) keeps that part."""
    before, after = (pp - 1) / (m // 2 + pp - 1), (pp - 1) / (m + pp - 1)
    saved = finding.cost_fraction * (1.0 - after / before)
    return {
        "fraction": round(saved, 4),
        "basis": f"measured bubble x (1 - b(m={m}) / b(m={m // 2})), b = (pp-1)/(m+pp-1)",
    }


def for_throttling(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    why = (
        f"{finding.message}; check cooling and power limits (nvidia-smi -q -d PERFORMANCE,POWER,TEMPERATURE) and "
        "move the job off that node if it persists"
    )
    return [_no_lever(why, "full clocks again on that device").gaining(gain(finding, ALL_OF_IT, "the clock lost"))]


def for_hang(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    why = (
        f"read the Python stacks of ranks {finding.ranks} in {finding.evidence.get('stacks_dir') or 'RUN_DIR/hang/'}:"
        " a rank outside the collective the others wait in is usually a rank-dependent branch, an exception "
        "swallowed on one rank, or a deadlocked data loader"
    )
    return [_no_lever(why, "the job completes").gaining({"fraction": 1.0, "basis": "the run completes"})]


def for_crash(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    ev = finding.evidence
    resume = "then resume=RUN_DIR continues from the newest complete checkpoint"
    if ev.get("exception") is None and ev.get("failure"):  # killed without a record of its own (run.json)
        why = (
            f"find out why rank {ev.get('rank')} ended ({ev['failure']}): the kernel's out-of-memory killer (dmesg), "
            f"the scheduler, or a crash below Python (its log, train_rank<N>.log); {resume}"
        )
        return [_no_lever(why, "the run completes")]
    where = f" at {ev['raised_at']}" if ev.get("raised_at") else ""
    why = (
        f"fix the error rank {ev.get('rank')} raised{where} (its traceback: {ev.get('record') or 'RUN_DIR'}); {resume}"
    )
    return [_no_lever(why, "the run completes")]


# Not measured: the usual remedies for a loss or gradients that turn NaN/inf, to try in this order.
TRIED_NOT_MEASURED = {"fraction": 0.0, "basis": "not measured: whether it avoids the non-finite step shows in a rerun"}
MIN_WARMUP_STEPS = 100  # a warm-up shorter than this rarely protects Adam's first, noisy moment estimates


def for_nonfinite(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    ev = finding.evidence
    stopped = ev.get("action") == "stopped"
    recs = _stability_levers(ctx, ev)
    if stopped and ev.get("policy") == "stop":
        why = (
            "drop the update of a rare bad step and go on (up to trainer.max_nan_skips of them) instead of stopping; "
            "it hides nothing: each skip is recorded and reported. Only for rare spikes: a diverging run skips until "
            "it stops anyway"
        )
        recs.append(_rec("trainer.nan_policy", "skip", why, "the run rides over an isolated non-finite step"))
    last = ev.get("last_good_checkpoint")
    if stopped and last:
        path = Path(str(last))
        # The run dir resumes from its newest complete checkpoint, which is the last good one (none is written for
        # the bad step); a checkpoint outside a run's checkpoints/ is resumed from directly.
        target = path.parent.parent if path.parent.name == "checkpoints" else path
        why = (
            f"continues from the last good checkpoint ({path.name}) with any of the changes above that a resume takes "
            "(trainer.grad_clip, trainer.nan_policy, optimizer.warmup_steps); the base lr comes from the "
            "checkpoint's schedule, so a lower optimizer.lr needs a fresh run"
        )
        recs.append(_rec("resume", str(target), why, "the steps before the bad one are kept"))
    elif stopped:
        recs.append(_no_lever("no checkpoint was saved before the bad step: rerun with a change above", "-"))
    return [replace(r, ab_testable=False).gaining(TRIED_NOT_MEASURED) if r.key else r for r in recs]


def _stability_levers(ctx: RunContext, ev: dict[str, Any]) -> list[Recommendation]:
    """Lower lr, longer warm-up, clipping, a safer precision: each only where the run's config leaves room."""
    lr, warmup, clip = ctx.get("optimizer.lr"), ctx.get("optimizer.warmup_steps"), ctx.get("trainer.grad_clip")
    step = ev.get("stopped_at_step")
    if step is None and ev.get("skipped_steps"):
        step = ev["skipped_steps"][0]
    levers: list[Recommendation] = []
    if isinstance(lr, int | float) and not isinstance(lr, bool) and lr > 0:
        why = (
            "a learning rate too high for this model and batch is the most common cause of a loss that diverges to "
            f"NaN; half of {lr:g}"
        )
        levers.append(_rec("optimizer.lr", float(f"{lr / 2:.3g}"), why, "smaller updates, slower early progress"))
    if isinstance(warmup, int) and not isinstance(warmup, bool):
        longer = max(2 * warmup, MIN_WARMUP_STEPS)
        at = (
            f" (the bad step, {step}, came {'during' if isinstance(step, int) and step < warmup else 'after'} it)"
            if isinstance(step, int)
            else ""
        )
        why = (
            f"a longer warm-up, {longer} steps instead of {warmup}{at}, keeps early updates small while Adam's moment "
            "estimates settle"
        )
        levers.append(_rec("optimizer.warmup_steps", longer, why, "a gentler start; the peak lr is reached later"))
    if isinstance(clip, int | float) and not isinstance(clip, bool) and clip <= 0:
        why = "gradient clipping is off (trainer.grad_clip=0): one large gradient can push the weights to inf"
        levers.append(_rec("trainer.grad_clip", 1.0, why, "every update's norm bounded by 1.0"))
    return levers + _safer_precision(ctx)


def _safer_precision(ctx: RunContext) -> list[Recommendation]:
    precision = ctx.get("precision.name")
    if precision == "fp16-mixed":
        why = "fp16 overflows above 65504; bf16 has fp32's exponent range (overflow only above ~3e38)"
        return [_rec("precision", "bf16-mixed", why, "no fp16 overflow; same speed on GPUs with bf16")]
    if precision == "bf16-true":
        why = "bf16-true keeps the weights and optimizer states in bf16; bf16-mixed keeps fp32 master weights"
        return [_rec("precision", "bf16-mixed", why, "fp32 weight updates; more memory for the fp32 copies")]
    if precision == "bf16-mixed":
        why = "rules reduced precision out as the cause: fp32 throughout"
        return [_rec("precision", "fp32", why, "slower steps and more activation memory; a diagnosis, not a fix")]
    return []


# Where a capacity limit is suggested: Switch Transformer's and GShard's usual training value.
CAPACITY_FACTOR = 1.25
AUX_LOSS_DEFAULT = 0.01  # the load-balancing weight Switch, Mixtral (0.02) and OLMoE train with, order of magnitude
AUX_LOSS_MAX = 0.1  # beyond it the balancing term competes with the LM loss (Switch: quality drops past ~0.1)


def for_expert_imbalance(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    ev = finding.evidence
    recs: list[Recommendation] = []
    coef = float(ev.get("aux_loss_coef") or 0.0)
    stronger = AUX_LOSS_DEFAULT if coef <= 0 else min(AUX_LOSS_MAX, 10 * coef)
    balance_key = ev.get("aux_loss_key", "model.aux_loss_coef")
    if balance_key and stronger > coef:
        why = (
            f"the load-balancing loss ({balance_key}={coef:g}) leaves expert {ev.get('hottest_expert')} with "
            f"{pct(float(ev.get('hottest_expert_share') or 0))} of layer {ev.get('layer')}'s assignments"
        )
        effect = "the router spreads tokens more evenly over training; a larger share of the loss is balancing"
        recs.append(
            _rec(balance_key, stronger, why, effect).gaining(
                gain(finding, HALF, "assumed: a stronger balancing loss removes about half of the excess over a run")
            )
        )
    capacity = ev.get("capacity_factor")
    capacity_key = ev.get("capacity_key", "model.capacity_factor")
    excess = float(ev.get("load_excess") or 0.0)
    recs += _placement_lever(finding, ctx, excess)
    if capacity_key and (capacity is None or float(capacity) > CAPACITY_FACTOR) and excess > CAPACITY_FACTOR - 1.0:
        # Each expert computes at most capacity_factor x its even share, so the busiest rank's excess over the mean
        # shrinks to about capacity_factor - 1 of it.
        share = 1.0 - (CAPACITY_FACTOR - 1.0) / excess
        why = (
            f"the busiest rank computes {pct(excess)} more expert work than the mean of its group; a capacity of "
            f"{CAPACITY_FACTOR}x the even share caps it"
        )
        effect = "assignments beyond capacity are dropped (those tokens skip the expert): check the loss"
        recs.append(
            _rec(capacity_key, CAPACITY_FACTOR, why, effect).gaining(
                gain(finding, share, f"the excess capped at {CAPACITY_FACTOR - 1:.2f} of the mean load")
            )
        )
    # A placement first where it expects the most: it leaves the model's function alone (the other two change the
    # training) and its gain is read from the measured loads.
    placed = [r for r in recs if r.key == "strategy.expert_placement"]
    if placed and _gain_of(placed[0]) >= max(_gain_of(r) for r in recs):
        return placed + [r for r in recs if r not in placed]
    return recs


def _gain_of(rec: Recommendation) -> float:
    return float(rec.expected_gain.get("fraction") or 0.0)


def _placement_lever(finding: Finding, ctx: RunContext, excess: float) -> list[Recommendation]:
    """The experts re-placed on the group's ranks so that the measured loads even out (strategy=fsdp's
    ``strategy.expert_placement``; the tp ranks of strategy=megatron split experts in order)."""
    ev = finding.evidence
    placement, after = ev.get("balanced_placement"), float(ev.get("load_excess_balanced") or 0.0)
    if not placement or not excess or ctx.get("strategy.name") != "fsdp" or after > excess * (1 - PLACEMENT_MIN_CUT):
        return []
    why = (
        f"the group's busiest rank computes {pct(excess)} more expert work than the mean; holding the experts as "
        f"placed here, the same measured loads leave it {pct(after)} above"
    )
    effect = "the same model and tokens; only which rank computes which expert changes (checkpoints are unaffected)"
    basis = "the measured per-expert loads re-placed: the busiest rank's excess over the mean, before and after"
    return [
        _rec("strategy.expert_placement", placement, why, effect).gaining(gain(finding, 1.0 - after / excess, basis))
    ]


RECOMMENDERS = {
    "expert_imbalance": for_expert_imbalance,
    "crash": for_crash,
    "nonfinite": for_nonfinite,
    "input_bound": for_input_bound,
    "straggler": for_straggler,
    "comm_bound": for_comm_bound,
    "low_overlap": for_low_overlap,
    "memory_pressure": for_memory_pressure,
    "host_overhead": for_host_overhead,
    "low_mfu": for_low_mfu,
    "pipeline_bubble": for_pipeline_bubble,
    "pauses": for_pauses,
    "throttling": for_throttling,
    "hang": for_hang,
}


def _free_cores_for_loading(ctx: RunContext, finding: Finding) -> str | None:
    """Loader workers that compute batches need cores of their own; workers that wait (I/O, a remote store) do not.
    The training thread's CPU share of its data wait tells which (unknown in older telemetry: then any busy host
    refuses, as it does once workers already run, whose CPU is not on this thread)."""
    if not ctx.host_cores_busy():
        return None
    shares = (finding.evidence.get("data_cpu_share") or {}).values()
    waiting = shares and max(shares) < CPU_BOUND_LOADING and not ctx.get("data.num_workers")
    if waiting:
        return None
    threads = ctx.num_threads or ctx.get("trainer.num_threads") or "all"
    return (
        f"every core is busy ({ctx.ranks_per_host or ctx.local_ranks()} rank(s) x {threads} thread(s) on "
        f"{ctx.cpu_count} cores) and loading computes: loader workers would take cores from the compute they feed"
    )


def _builtin_optimizer(ctx: RunContext, finding: Finding) -> str | None:
    if ctx.lightning_module:
        return "your LightningModule builds its optimizer and schedule in configure_optimizers (set them there)"
    return None


def _builtin_layers(ctx: RunContext, finding: Finding) -> str | None:
    if ctx.lightning_module:
        return "a LightningModule's submodules compile in inductor's default mode (model.compile=true), no other"
    return None


def _accumulates(ctx: RunContext, finding: Finding) -> str | None:
    if ctx.manual_optimization:
        return "your LightningModule optimizes manually, and Lightning accumulates micro-batches only for automatic"
    return None


def _several_ranks(ctx: RunContext, finding: Finding) -> str | None:
    world = ctx.batch.get("data_parallel_size")
    return "one data-parallel rank has no gradient traffic to change" if world == 1 else None


# The training thread's CPU time over its data wait above which loading is CPU work (a worker needs a free core).
CPU_BOUND_LOADING = 0.5
# What each lever needs of the run's own evidence, in one place for every finding kind: a recommendation whose key is
# here and whose need the run contradicts is not made (it is explained instead). Measured on 2 ranks x 1 thread on 2
# cores: one loader worker per rank made a heavy __getitem__ run slower (46-50 ms vs 44 ms a step).
LEVER_NEEDS: dict[str, Callable[[RunContext, Finding], str | None]] = {
    "data.num_workers": _free_cores_for_loading,
    "+data.num_workers": _free_cores_for_loading,
    "strategy.comm_hook": _several_ranks,
    "strategy.bucket_cap_mb": _several_ranks,
    "optimizer": lambda ctx, f: _builtin_optimizer(ctx, f) or _several_ranks(ctx, f),  # 1-bit Adam needs peers
    "optimizer.lr": _builtin_optimizer,
    "optimizer.warmup_steps": _builtin_optimizer,
    "model.compile_mode": _builtin_layers,
    "trainer.global_batch_size": _accumulates,
}


def gated(recs: list[Recommendation], ctx: RunContext, finding: Finding) -> list[Recommendation]:
    """``recs`` without the levers the run's evidence rules out, each replaced by the reason it is not made."""
    out: list[Recommendation] = []
    for rec in recs:
        need = LEVER_NEEDS.get(rec.key or "")
        reason = need(ctx, finding) if need is not None else None
        if reason is None:
            out.append(rec)
        else:
            out.append(_no_lever(f"{rec.key}={rec.value} would not help: {reason}", "-"))
    return out


def recommend(finding: Finding, ctx: RunContext) -> list[Recommendation]:
    """Ranked recommendations for one finding, most effective first; none the run's evidence contradicts."""
    return gated(RECOMMENDERS[finding.kind](finding, ctx), ctx, finding)


def recommend_all(analysis: Analysis) -> list[list[Recommendation]]:
    """Recommendations of every finding of ``analysis``, in the findings' order."""
    ctx = RunContext.from_run(analysis.run)
    return [recommend(f, ctx) for f in analysis.findings]


@dataclass(frozen=True)
class AbTest:
    """One Hydra multirun: the original overrides, ``pinned``, and ``key`` swept over (original, recommended).

    ``original`` and ``recommended`` are the two arms as plain ``python -m train`` overrides, for a runner that
    launches them one run at a time (``diagnostics.ab``); ``override`` is the recommendation's own override.
    """

    key: str
    argv: tuple[str, ...]  # arguments after ``python -m train``
    note: str
    original: tuple[str, ...] = ()
    recommended: tuple[str, ...] = ()
    override: str = ""
    # The share of the step the recommendation expects to save: stored beside the measured change in the verdict.
    expected_gain: float | None = None
    finding: str | None = None  # the kind of the finding it answers (the advice ledger scores advice per kind)
    metric: str = "tokens_per_s"  # what its arms compare (Recommendation.metric)

    def shell(self) -> str:
        return f"# {self.note}\npython -m train " + " ".join(shlex.quote(a) for a in self.argv)


def _sets(override: str, key: str) -> bool:
    """Whether ``override`` sets ``key`` or, for a config group, one of its sub-keys."""
    name = override.split("=", 1)[0].lstrip("+~")
    bare = key.lstrip("+~")
    return name == bare or ("." not in bare and name.startswith(bare + "."))


def ab_test(rec: Recommendation, ctx: RunContext, original: list[str], run_dir: Path) -> AbTest | None:
    """The A/B sweep of one recommendation, or None when it has no override."""
    if rec.key is None or rec.value is None:
        return None
    changed = [rec.key, *(p.split("=", 1)[0] for p in rec.pinned)]
    base = [o for o in original if not any(_sets(o, k) for k in changed)]
    dropped = [o for o in original if o not in base]
    known, value = ctx.current(rec.key)
    slug = rec.key.lstrip("+~").replace("/", "_")
    sweep_dir = f"hydra.sweep.dir={Path(run_dir).resolve() / 'ab' / slug}"
    key = rec.key
    if not key.startswith("+") and any(o.startswith("+") and _sets(o, key) for o in dropped):
        key = "+" + key  # the original added this key (e.g. to a custom datamodule): the sweep must add it too
    if known:
        swept = f"{key}={hydra_value(value)},{rec.value}"
        arms = f"job 0 = original ({rec.key}={hydra_value(value)}), job 1 = {rec.key}={rec.value}"
    else:
        # Without run.json the original value is unknown: the analysed run itself is the A arm.
        swept = f"{key}={rec.value}"
        arms = f"original value unknown: compare with {run_dir}"
    note = f"A/B {rec.key}: {arms}" + (f"; replaces {' '.join(dropped)}" if dropped else "")
    multirun = ("-m", *base, *rec.pinned, swept, sweep_dir)
    recommended = (*base, *rec.pinned, f"{key}={rec.value}")
    gain = rec.expected_gain.get("fraction")
    expected = float(gain) if isinstance(gain, (int, float)) and rec.gain_estimated else None
    return AbTest(rec.key, multirun, note, tuple(original), recommended, rec.override, expected, metric=rec.metric)


def _original_overrides(analysis: Analysis) -> list[str]:
    # The A/B jobs get their own directories and start fresh: the run's own dir, sweep and resume do not apply.
    overrides = analysis.run.overrides or []
    return [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "resume="))]


def ab_tests(analysis: Analysis, recommendations: list[list[Recommendation]], top_k: int) -> list[AbTest]:
    """A/B sweeps for the ``top_k`` highest-ranked distinct keys among the recommendations."""
    ctx = RunContext.from_run(analysis.run)
    original = _original_overrides(analysis)
    tests: list[AbTest] = []
    for finding, recs in zip(analysis.findings, recommendations, strict=False):
        for rec in recs:
            if len(tests) >= top_k:
                return tests
            if any(t.key == rec.key for t in tests) or not rec.ab_testable:
                continue
            if (test := ab_test(rec, ctx, original, analysis.run.run_dir)) is not None:
                tests.append(replace(test, finding=finding.kind))
    return tests
