"""Human-readable text: what a run would launch (dry runs and every run's banner) and how it ended."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from disttrain.config.schema import CUDAGRAPH_MODES, LightningModuleConfig, RunConfig
from disttrain.strategies.layout import ParallelLayout

if TYPE_CHECKING:
    from disttrain.models.facts import ModelFacts


def _options(obj: object) -> str:
    fields = dataclasses.asdict(obj)  # type: ignore[call-overload]
    return ", ".join(f"{k}={v}" for k, v in fields.items() if k != "name") or "defaults"


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def describe_launch(cfg: RunConfig, parallel: ParallelLayout, facts: ModelFacts) -> str:
    hw, layout, plan = cfg.hw, parallel.world, parallel.batch
    device = "CPU process" if hw.accelerator == "cpu" else f"GPU ({hw.device_type})"
    tokens = facts.tokens_per_sample
    per_step = (
        f"{plan.global_batch_size * tokens:,} tokens/step" if tokens else f"{plan.global_batch_size:,} samples/step"
    )
    total = plan.global_batch_size * cfg.trainer.max_steps * (tokens or 1)
    lines = [
        f"hardware     hw={hw.name}: {layout.num_nodes} node(s) x {layout.devices_per_node} {device}"
        f" = world size {layout.world_size}",
        f"strategy     {cfg.strategy.name} ({_options(cfg.strategy)}), data-parallel size {layout.data_parallel_size}",
        f"precision    {cfg.precision.name}"
        + (
            f" ({cfg.precision.recipe} scaling{', the head too' * cfg.precision.fp8_head}; MFU against the bf16 peak)"
            if cfg.precision.fp8
            else ""
        )
        + f" (compute dtype {cfg.precision.compute_dtype})",
        f"model        {_model_line(cfg, facts)}" + _compiled(cfg.model),
        f"batch        global {plan.global_batch_size} = micro {plan.micro_batch_size} x dp {plan.data_parallel_size}"
        f" x accumulation {plan.accumulation}; {per_step}",
        f"data         {cfg.data.name} ({_options(cfg.data)})",
        f"optimizer    {_optimizer_line(cfg)}",
        f"schedule     {cfg.trainer.max_steps} steps = {human_count(total)} {'tokens' if tokens else 'samples'},"
        f" val every {cfg.trainer.val_every_n_steps}, {_checkpoints(cfg.trainer.ckpt_every_n_steps)}",
    ]
    return "\n".join(lines)


def _model_line(cfg: RunConfig, facts: ModelFacts) -> str:
    n = facts.num_parameters
    if isinstance(cfg.model, LightningModuleConfig):
        stated = facts.stated_flops_per_sample
        flops = f"{human_count(stated)}FLOP/sample (its own)" if stated else "FLOPs counted on an early micro-batch"
        tokens = f", {facts.tokens_per_sample} tokens/sample" if facts.tokens_per_sample else ""
        return f"{cfg.model.target} (your LightningModule): {n:,} parameters ({human_count(n)}){tokens}, {flops}"
    flops_per_token = facts.flops_per_token or 0.0
    return (
        f"{cfg.model.name}: {n:,} parameters ({human_count(n)}), seq_len {cfg.model.seq_len}, "
        f"{human_count(flops_per_token)}FLOP/token (6N + 12LHQT)"
    )


def _optimizer_line(cfg: RunConfig) -> str:
    if isinstance(cfg.model, LightningModuleConfig):
        return "the module's own configure_optimizers"
    o = cfg.optimizer
    return f"{o.name}: lr {o.lr:g}, warmup {o.warmup_steps}, weight decay {o.weight_decay:g}" + _onebit(cfg)


def _checkpoints(every_n_steps: int) -> str:
    return f"checkpoint every {every_n_steps}" if every_n_steps else "no checkpoints (trainer.ckpt_every_n_steps=0)"


@dataclass(frozen=True)
class RunResult:
    steps: int
    wall_time_s: float
    train_loss: float | None
    val_loss: float | None
    loss_floor: float | None
    entropy_rate: float | None
    tokens_per_s: float | None
    run_dir: str
    samples_per_s: float | None = None
    # A LightningModule's own logged metrics at the end (name -> value): its losses are not nats per token.
    metrics: dict[str, float] | None = None
    step_time_p50_s: float | None = None  # the median optimizer step after the warm-up (Throughput)
    predicted_memory_bytes: int | None = None
    measured_memory_bytes: int | None = None
    memory_kind: str = "peak RSS"

    @property
    def gap_to_floor(self) -> float | None:
        if self.val_loss is None or self.loss_floor is None:
            return None
        return self.val_loss - self.loss_floor


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)


def describe_result(result: RunResult) -> str:
    lines = [f"done: {result.steps} steps in {result.wall_time_s:.1f} s"]
    if result.metrics is not None:
        shown = "   ".join(f"{name} {value:.4g}" for name, value in result.metrics.items())
        lines.append(f"  metrics     {shown or 'none logged'}")
    else:
        lines.append(f"  loss        train {_fmt(result.train_loss)}   val {_fmt(result.val_loss)} (nats/token)")
    if result.loss_floor is not None:
        lines.append(
            f"  loss floor  {_fmt(result.loss_floor)} for these windows (entropy rate {_fmt(result.entropy_rate)});"
            f" val gap to floor {_fmt(result.gap_to_floor, '+.4f')}"
        )
    median = f"; median step {1e3 * result.step_time_p50_s:.1f} ms" if result.step_time_p50_s else ""
    if result.tokens_per_s is not None or result.samples_per_s is None:
        rate = f"{_fmt(result.tokens_per_s, ',.0f')} tokens/s"
    else:
        rate = f"{_fmt(result.samples_per_s, ',.1f')} samples/s"
    lines.append(f"  throughput  {rate} (training steps only{median})")
    if result.measured_memory_bytes:
        measured = f"{result.memory_kind} {result.measured_memory_bytes / 2**30:.2f} GiB (rank 0)"
        if result.predicted_memory_bytes:
            runtime = "; RSS also holds the Python/torch runtime" if result.memory_kind == "peak RSS" else ""
            measured = f"predicted {result.predicted_memory_bytes / 2**30:.2f} GiB, {measured}{runtime}"
        lines.append(f"  memory      {measured}")
    lines.append(f"  run dir     {result.run_dir}")
    return "\n".join(lines)


def _compiled(model: object) -> str:
    if not getattr(model, "compile", False):
        return ""
    mode = getattr(model, "compile_mode", None)
    if mode in CUDAGRAPH_MODES:
        return f", torch.compile ({mode}: CUDA graphs)"
    return ", torch.compile" + (f" ({mode})" if mode else "")


def _onebit(cfg: RunConfig) -> str:
    if cfg.optimizer.name != "onebit_adam":
        return ""
    return f"; 1-bit momentum exchange after {cfg.optimizer.freeze_steps} plain steps"
