"""What every kind's recommendations are made of: a ``Recommendation`` (a Hydra override with its reason, its
expected effect and its gain sized from the finding's cost), and the batch and compile levers several kinds share.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from diagnostics.analysis.context import RunContext, hydra_value
from diagnostics.analysis.finding import Finding

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


def lever(key: str | None, value: Any, why: str, effect: str, pinned: tuple[str, ...] = ()) -> Recommendation:
    return Recommendation(key, None if key is None else hydra_value(value), why, effect, pinned)


def no_lever(why: str, effect: str) -> Recommendation:
    return Recommendation(None, None, f"No config lever: {why}", effect)


# What each lever is expected to recover of its finding's cost, and why (keyed by override key, or value).
ALL_OF_IT = 1.0


HALF = 0.5


def kept_global(ctx: RunContext) -> tuple[str, ...]:
    return (f"trainer.global_batch_size={ctx.global_batch()}",) if ctx.global_batch() else ()


def bigger_global(ctx: RunContext, why: str, effect: str) -> list[Recommendation]:
    current = ctx.global_batch()
    if not current:
        return []
    # Doubling keeps it a multiple of micro x dp; accumulation doubles, so the optimizer sees twice the tokens.
    return [lever("trainer.global_batch_size", 2 * current, why, effect)]


def smaller_micro(ctx: RunContext) -> list[Recommendation]:
    micro = ctx.micro() or 0
    divisors = [d for d in range(micro - 1, 0, -1) if micro % d == 0] if micro and micro > 1 else []
    if not divisors or not ctx.global_batch():
        return []
    # A divisor of micro keeps the global batch a multiple of micro x dp: same optimization, more accumulation.
    return [
        lever(
            "trainer.micro_batch_size",
            divisors[0],
            f"activations scale with the micro batch; {divisors[0]} instead of {micro} with the global batch kept at "
            f"{ctx.global_batch()} (more accumulation) leaves the optimization unchanged",
            f"activation memory about {divisors[0] / micro:.0%} of now; slightly lower throughput",
            kept_global(ctx),
        )
    ]


def larger_micro(ctx: RunContext) -> list[Recommendation]:
    micro, keep = ctx.micro(), (ctx.batch.get("accumulation") or 1) % 2 == 0
    if not micro:
        return []
    # With even accumulation the global batch can stay (half the accumulation); otherwise it doubles too.
    batch = f"the global batch stays {ctx.global_batch()}" if keep else "the global batch doubles with it (retune lr)"
    why = f"bigger matmuls per launch amortize per-step overhead; {batch}"
    return [
        lever(
            "trainer.micro_batch_size",
            2 * micro,
            why,
            "higher device efficiency if memory allows",
            kept_global(ctx) if keep else (),
        )
    ]


def compile_levers(ctx: RunContext) -> list[Recommendation]:
    if ctx.get("model.compile") is True:
        return cuda_graph_levers(ctx)
    if ctx.get("model.compile") is not False:
        return []
    why = "torch.compile fuses small ops: fewer kernel launches and Python calls per step"
    return [lever("model.compile", True, why, "less host overhead, higher achieved FLOP/s")]


def cuda_graph_levers(ctx: RunContext) -> list[Recommendation]:
    """Compiled blocks still launched kernel by kernel: CUDA graphs replay each block in one launch (DDP, dense
    models: what the config accepts; the H200 figures: benchmarks/RESULTS.md, "Figures moved from the code")."""
    if not ctx.on_gpu or ctx.get("strategy.name") != "ddp" or (ctx.get("model.num_experts") or 0) > 0:
        return []
    if not ctx.has("model.compile_mode"):  # a model=hf or user model: compiled whole, no mode key to set
        return []
    if ctx.get("model.compile_mode") in ("reduce-overhead", "max-autotune"):
        return []
    why = "CUDA graphs replay each compiled block's kernels in one launch instead of launching them one by one"
    return [lever("model.compile_mode", "reduce-overhead", why, "less host time per step on a launch-bound GPU")]
