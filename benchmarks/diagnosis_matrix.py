"""A generated matrix of diagnosis scenarios: strategy x fault x rank x magnitude x model, drawn from a seed.

A fixed list of scenarios invites tuning the detectors to it; a new seed draws a new matrix. Each draw is a CPU run
(2 ranks, or ``world`` ranks: 4 share this box's 2 cores) with one injected fault (``benchmarks/injected.py``) and
its counterfactual, the same run without the fault. The fault's size is a share of the counterfactual's own step
(``magnitude``, 10% to 300%), so the counterfactual runs first and the fault is scaled from what it measured.
A fault holds its rank asleep (a wait: I/O, a remote store) or computing (more work, a slower core: ``work``,
``--work compute|mixed``); the two differ where ranks share cores. Ground truth is the measured cost (1 - mean
throughput with the fault / without it), not the injector's label: a fault that costs less than ``HEALTHY_GAIN`` of
the run is judged as a healthy run (no warning or critical finding), and a slow link is ``comm_bound`` only where its
measured cost reaches comm_bound's threshold (``low_overlap`` below).

Pure: drawing and describing scenarios; ``diagnosis_accuracy.py --seed N`` runs them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

STRATEGIES: dict[str, list[str]] = {
    "ddp": [],
    "fsdp": ["strategy=fsdp"],
    "deepspeed-2": ["strategy=deepspeed", "strategy.stage=2"],
    "deepspeed-3": ["strategy=deepspeed", "strategy.stage=3"],
    "megatron-tp2": ["strategy=megatron", "strategy.tp=2"],
    "megatron-pp2": ["strategy=megatron", "strategy.pp=2", "trainer.micro_batch_size=4"],
}
# forward/backward/optimizer: one rank slow in that phase every step; data-one/data-all: slow batches on one rank /
# on every rank; stall: one rank held in one phase every ``every``-th step; slow-link: DDP's gradient all-reduce over
# an emulated slow link; none: nothing injected.
FAULTS = ("forward", "backward", "optimizer", "data-one", "data-all", "stall", "slow-link", "none")
# user: an nn.Module token model of the user's (its forward and backward are the injection points); lit-conv and
# lit-embed: a user's own LightningModule (benchmarks/injected.py: a conv-net classifier, an embedding recommender)
# trained as written, its samples the unit of work.
MODELS = ("builtin", "user", "hf", "lit-conv", "lit-embed")
OWN_INJECTIONS = ("user", "lit-conv", "lit-embed")  # models whose own forward/backward can hold a rank
MAGNITUDE = (0.1, 3.0)  # of the counterfactual's step
STALL_EVERY = (4, 10)
WORK_CHOICES = ("sleep", "compute", "mixed")  # mixed: each draw's fault asleep or computing, drawn per draw

PLUGIN_DATA = ["~data", "+data._target_=benchmarks.injected.RandomTokens"]
USER_MODEL = [
    "~model",
    "+model._target_=benchmarks.injected.InjectedModel",
    "+model.vocab_size=256",
    "+model.seq_len=128",
    "+model.width=512",
]
LIT = ["~model", "+model._target_=benchmarks.injected.InjectedLightningModule"]
MODEL_OVERRIDES = {
    "builtin": [], "user": USER_MODEL, "hf": ["model=hf-tiny-llama"],
    "lit-conv": [*LIT, "+model.net=conv"], "lit-embed": [*LIT, "+model.net=embed"],
}  # fmt: skip
VOCAB = {"builtin": 256, "user": 256, "hf": 512}
LIT_DATA = ["~data", "+data._target_=benchmarks.injected.InjectedSamples"]
DATA_OVERRIDES = {
    **{model: [*PLUGIN_DATA, f"+data.vocab_size={vocab}"] for model, vocab in VOCAB.items()},
    # Fuller steps than the matrix's micro-batch of 8 gives: there the classifier's step is ~8 ms, mostly per-step
    # Python, and this box's run-to-run noise (counterfactuals of one cell 15% apart) is wider than the matrix's cost
    # tolerance, so no cost could be judged. The recommender's lookups are cheaper still.
    "lit-conv": [*LIT_DATA, "+data.net=conv", "trainer.micro_batch_size=64"],
    "lit-embed": [*LIT_DATA, "+data.net=embed", "trainer.micro_batch_size=256"],
}
MICRO_BATCH_KEY = "trainer.micro_batch_size="
MATRIX_MICRO_BATCH = [f"{MICRO_BATCH_KEY}8"]  # diagnosis_accuracy.py's MATRIX_BASE, which every run starts from
GRADIENT_BYTES = {"builtin": 4 * 1_828_992}  # fp32 gradients of gpt-nano, what DDP all-reduces per step
COMM_BOUND_FRACTION = 0.25  # diagnostics/kinds/comm_bound.py: a slow link below it is low_overlap


@dataclass(frozen=True)
class Draw:
    strategy: str
    fault: str
    rank: int | None  # the slow rank; None where every rank (data-all) or none (none, slow-link) is
    magnitude: float  # the fault's time per occurrence, as a share of the counterfactual's step
    model: str
    every: int = 1  # stall: one occurrence every N steps
    world: int = 2  # ranks of the run
    work: str = "sleep"  # the fault's time asleep or computing (benchmarks/injected.py ``hold``)

    @property
    def name(self) -> str:
        where = "all" if self.rank is None else f"rank{self.rank}"
        size = "" if self.fault == "none" else f"-{round(100 * self.magnitude)}pct"
        every = f"-every{self.every}" if self.every > 1 else ""
        world = f"-w{self.world}" if self.world != 2 else ""
        work = "-cpu" if self.work == "compute" else ""
        return f"{self.fault}-{where}-{self.strategy}-{self.model}{size}{every}{world}{work}"

    @property
    def inherent(self) -> tuple[str, ...]:
        """Findings the layout raises with or without a fault, which no counterfactual here removes: a 2-stage
        pipeline's bubble at its default micro-batches, and the communication of every layout but DDP (only DDP's
        gradients can be kept local, ``+data.local_grads``, to measure what its communication costs)."""
        bubble = ("pipeline_bubble",) if "strategy.pp=2" in STRATEGIES[self.strategy] else ()
        comm = () if self.strategy == "ddp" else ("low_overlap", "comm_bound")
        return bubble + comm

    def counterfactual(self) -> list[str]:
        """The run without the fault: strategy, model and the plug-in data every draw uses. A healthy DDP draw's is
        the same run without its gradient all-reduce: a healthy run is one with less than HEALTHY_GAIN to gain,
        communication included."""
        local = ["+data.local_grads=true"] if self.fault == "none" and self.strategy == "ddp" else []
        return [*self._base(), *local]

    def _base(self) -> list[str]:
        world = [f"hw.devices_per_node={self.world}"] if self.world != 2 else []
        return [
            *world,
            *STRATEGIES[self.strategy],
            *MODEL_OVERRIDES[self.model],
            *DATA_OVERRIDES[self.model],
        ]

    def lever_arms(self) -> list[tuple[tuple[str, ...], str, list[str]]]:
        """(findings, name, overrides): the counterfactuals that measure what a finding's own lever gains on the
        cell's run, whatever fault a draw adds. A finding whose arm gains HEALTHY_GAIN or more is the run's own,
        like an inherent one (it may come with or without the fault). DDP's communication is measured by keeping
        its gradients local, except on a healthy DDP draw, whose counterfactual already does (its warning must
        be worth it)."""
        arms: list[tuple[tuple[str, ...], str, list[str]]] = [(("host_overhead",), "amortized", self.amortized())]
        if self.strategy == "ddp" and self.fault != "none":
            local = [*self.counterfactual(), "+data.local_grads=true"]
            arms.append((("comm_bound", "low_overlap"), "local-grads", local))
        return arms

    def amortized(self) -> list[str]:
        """The counterfactual at twice its micro-batch: what host_overhead's own lever (more samples over the same
        per-step Python and framework work) gains. A tiny module's step can be mostly that work: a run that gains
        HEALTHY_GAIN or more here has that much to gain, and a host_overhead warning on it is not a healthy run's
        false alarm (the gain bounds the overhead's from above: a larger batch also runs its kernels fuller)."""
        base = self.counterfactual()
        sizes = [int(o.split("=", 1)[1]) for o in [*MATRIX_MICRO_BATCH, *base] if o.startswith(MICRO_BATCH_KEY)]
        return [*base, f"{MICRO_BATCH_KEY}{2 * sizes[-1]}"]

    def fault_overrides(self, step_s: float) -> list[str]:
        """The faulty run, its fault sized from the counterfactual's measured ``step_s``."""
        seconds = round(self.magnitude * step_s, 4)
        ranks = [] if self.rank is None else [f"+data.slow_ranks=[{self.rank}]"]
        model_ranks = [] if self.rank is None else [f"+model.slow_ranks=[{self.rank}]"]
        every = [f"+data.stall_every={self.every}"] if self.every > 1 else []
        work = [] if self.work == "sleep" else [f"+model.work={self.work}"]
        data_work = [] if self.work == "sleep" else [f"+data.work={self.work}"]
        base = self._base()
        if self.fault in ("forward", "backward") or (self.fault == "stall" and self.model in OWN_INJECTIONS):
            phase = "forward" if self.fault == "stall" else self.fault
            stall = [f"+model.stall_every={self.every}"] if self.every > 1 else []
            return [*base, f"+model.phase={phase}", f"+model.sleep_s={seconds}", *model_ranks, *stall, *work]
        if self.fault == "optimizer":
            return [*base, f"+data.optimizer_sleep_s={seconds}", *ranks, *data_work]
        if self.fault in ("data-one", "data-all", "stall"):
            return [*base, f"+data.delay_s={seconds}", *ranks, *every, *data_work]
        if self.fault == "slow-link":
            # The link takes magnitude x step to move a step's gradients.
            return [*base, f"+data.link_bytes_per_s={GRADIENT_BYTES[self.model] / max(seconds, 1e-3):.4g}"]
        return base

    def expected(self, measured_cost: float | None) -> tuple[str | None, list[int]]:
        """The finding the report should lead with, given the measured cost (None: a quiet, healthy report)."""
        if self.fault == "none" or (measured_cost is not None and measured_cost < HEALTHY_GAIN):
            return None, []
        every_rank = list(range(self.world))
        ranks = every_rank if self.rank is None else [self.rank]
        if self.fault == "slow-link":
            kind = "comm_bound" if measured_cost is None or measured_cost >= COMM_BOUND_FRACTION else "low_overlap"
            return kind, every_rank
        if self.fault in ("data-one", "data-all") or (self.fault == "stall" and self.model not in OWN_INJECTIONS):
            return "input_bound", ranks
        return "straggler", ranks


HEALTHY_GAIN = 0.05  # as in diagnosis_accuracy.py: below this measured cost a fault is not worth a warning


def compatible(strategy: str, fault: str, model: str, world: int = 2) -> bool:
    """What can run here: forward/backward faults need the user model (the injection points are its own); Megatron
    takes the reference model only, on an even number of ranks (tp=2 or pp=2 divides it); a slow link is DDP's comm
    hook over the built-in model (its gradient bytes are known); model=hf runs under DDP and FSDP."""
    megatron = strategy.startswith("megatron")
    if megatron and world % 2:
        return False
    if fault in ("forward", "backward") and model not in OWN_INJECTIONS:
        return False
    if megatron and model != "builtin":
        return False
    if fault == "slow-link":
        return strategy == "ddp" and model == "builtin"
    if model == "hf" and strategy not in ("ddp", "fsdp"):
        return False
    # Under tensor parallelism both ranks hold the same batch and wait for each other inside every layer: one slow
    # rank's data or work is everyone's; the rank-specific faults are for data-parallel layouts.
    return not (strategy == "megatron-tp2" and fault in ("forward", "backward", "data-one", "stall"))


def draw_matrix(seed: int, size: int = 40, world: int = 2, work: str = "sleep") -> list[Draw]:
    """``size`` scenarios from ``seed``: every fault kind and every strategy at least once (where compatible), the
    rest drawn uniformly over the compatible (strategy, fault, model) cells, with rank (of ``world``), magnitude
    (log-uniform) and stall period drawn per scenario. ``work``: every fault asleep, computing, or ``mixed`` (each
    draw's own, from a stream of its own, so a seed draws the same scenarios whatever ``work`` says)."""
    if work not in WORK_CHOICES:
        raise ValueError(f"work: unknown {work!r}; use one of {', '.join(WORK_CHOICES)}")
    rng, work_rng = random.Random(seed), random.Random(f"work-{seed}")
    cells = [(s, f, m) for s in STRATEGIES for f in FAULTS for m in MODELS if compatible(s, f, m, world)]
    chosen: list[tuple[str, str, str]] = []
    for fault in FAULTS:
        chosen.append(rng.choice([c for c in cells if c[1] == fault]))
    for strategy in [s for s in STRATEGIES if any(c[0] == s for c in cells)]:
        if not any(c[0] == strategy for c in chosen):
            chosen.append(rng.choice([c for c in cells if c[0] == strategy]))
    while len(chosen) < size:
        chosen.append(rng.choice(cells))
    draws = []
    for strategy, fault, model in chosen:
        rank = rng.randrange(world) if fault in ("forward", "backward", "optimizer", "data-one", "stall") else None
        low, high = MAGNITUDE
        magnitude = 0.0 if fault == "none" else round(math.exp(rng.uniform(math.log(low), math.log(high))), 3)
        every = rng.randint(*STALL_EVERY) if fault == "stall" else 1
        kind = work_rng.choice(("sleep", "compute")) if work == "mixed" else work
        kind = "sleep" if fault in ("none", "slow-link") else kind  # nothing held / the link's delay is a wait
        draws.append(Draw(strategy, fault, rank, magnitude, model, every, world, kind))
    return draws
