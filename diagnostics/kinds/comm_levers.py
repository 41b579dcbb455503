"""Communication levers shared by ``comm_bound`` and ``low_overlap``: DDP's comm hooks (bf16, PowerSGD), 1-bit Adam,
and moving tensor parallelism inside a node; each sized from the run's measured communication split.
"""

from __future__ import annotations

from typing import Any

from diagnostics.analysis.comm_split import strategy_split
from diagnostics.analysis.context import RunContext
from diagnostics.analysis.finding import Finding, pct
from diagnostics.analysis.thresholds import TP_MATERIAL
from diagnostics.kinds.levers import HALF, Recommendation, gain, lever

# PowerSGD's default rank and warm-up (conf/strategy/ddp.yaml); a matrix below this width compresses < 8x.
POWERSGD_RANK = 4


POWERSGD_WARMUP_STEPS = 50


POWERSGD_MIN_WIDTH = 64


def onebit_adam(ctx: RunContext) -> bool:
    """Whether the run is 1-bit Adam's: after its warm-up the momentum crosses the wire inside the optimizer step,
    compressed already, and DDP's buckets carry nothing (hooks, bucket sizes and other strategies do not apply)."""
    return ctx.get("optimizer.name") == "onebit_adam"


def ddp_comm_hooks(ctx: RunContext, finding: Finding) -> list[Recommendation]:
    """DDP comm hooks that send fewer bytes than the run did (strategy.comm_hook), smallest change first."""
    if onebit_adam(ctx):
        return []
    hook = ctx.get("strategy.comm_hook") or "none"
    recs: list[Recommendation] = []
    if hook == "none" and ctx.get("precision.name") != "bf16-true":  # bf16-true gradients are 2 bytes already
        why = "gradients are all-reduced in fp32; a bf16 copy of each bucket keeps fp32's range at half the size"
        half = gain(finding, HALF, "half the bytes: half of the exposed communication time (bandwidth-bound)")
        recs.append(lever("strategy.comm_hook", "bf16", why, "half the gradient all-reduce bytes").gaining(half))
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
        recs.append(lever("strategy.comm_hook", "powersgd", why, effect, pinned).gaining(most))
    if hook == "none" and ctx.get("optimizer.name") == "adamw":
        why = (
            "1-bit Adam exchanges the momentum instead of the gradients, as signs with one scale per 512 values "
            "(~1/30 of fp32's bytes), after a warm-up of plain AdamW; error feedback keeps what compression loses"
        )
        effect = "gradient traffic cut ~30x after the freeze; the optimizer changes: check the loss curve"
        measured = "an emulated 40 MB/s link: 143 of its 183 ms exposed a step gone, 1.26x tokens/s (RESULTS.md)"
        most = gain(finding, 0.8, f"most of the exposed communication, as on {measured}")
        recs.append(lever("optimizer", "onebit_adam", why, effect).gaining(most))
    rank = ctx.get("strategy.powersgd_rank")
    if hook == "powersgd" and isinstance(rank, int) and rank > 1:
        why = f"the P and Q factors grow with the rank: rank {rank // 2} sends half of what rank {rank} does"
        effect = "half the compressed bytes; a coarser gradient"
        half = gain(finding, HALF, "half of the compressed bytes' exposed time")
        recs.append(lever("strategy.powersgd_rank", rank // 2, why, effect).gaining(half))
    return recs


def comm_split_of(finding: Finding, ctx: RunContext) -> dict[str, Any]:
    """The finding's split of the communication by lever, else the strategy's (an older report: none recorded)."""
    return finding.evidence.get("comm_split") or strategy_split(ctx) or {}


def tensor_parallel_levers(finding: Finding, ctx: RunContext, split: dict[str, Any]) -> list[Recommendation]:
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
    return [lever("strategy.tp", half, why, effect, pinned).gaining(gain(finding, kept * tp_share, basis))]
