"""Human-readable text: what a run would launch (dry runs and every run's banner) and how it ended."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from disttrain.config.schema import CUDAGRAPH_MODES, RunConfig
from disttrain.strategies.layout import ParallelLayout


def _options(obj: object) -> str:
    fields = dataclasses.asdict(obj)  # type: ignore[call-overload]
    return ", ".join(f"{k}={v}" for k, v in fields.items() if k != "name") or "defaults"


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def describe_launch(cfg: RunConfig, parallel: ParallelLayout, num_parameters: int, flops_per_token: float) -> str:
    hw, layout, plan = cfg.hw, parallel.world, parallel.batch
    device = "CPU process" if hw.accelerator == "cpu" else f"GPU ({hw.device_type})"
    tokens_per_step = plan.global_batch_size * cfg.model.seq_len
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
        f"model        {cfg.model.name}: {num_parameters:,} parameters ({human_count(num_parameters)}),"
        f" seq_len {cfg.model.seq_len}, {human_count(flops_per_token)}FLOP/token (6N + 12LHQT)" + _compiled(cfg.model),
        f"batch        global {plan.global_batch_size} = micro {plan.micro_batch_size} x dp {plan.data_parallel_size}"
        f" x accumulation {plan.accumulation}; {tokens_per_step:,} tokens/step",
        f"data         {cfg.data.name} ({_options(cfg.data)})",
        f"optimizer    {cfg.optimizer.name}: lr {cfg.optimizer.lr:g}, warmup {cfg.optimizer.warmup_steps},"
        f" weight decay {cfg.optimizer.weight_decay:g}" + _onebit(cfg),
        f"schedule     {cfg.trainer.max_steps} steps = {human_count(tokens_per_step * cfg.trainer.max_steps)} tokens,"
        f" val every {cfg.trainer.val_every_n_steps}, {_checkpoints(cfg.trainer.ckpt_every_n_steps)}",
    ]
    return "\n".join(lines)


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
    lines = [
        f"done: {result.steps} steps in {result.wall_time_s:.1f} s",
        f"  loss        train {_fmt(result.train_loss)}   val {_fmt(result.val_loss)} (nats/token)",
    ]
    if result.loss_floor is not None:
        lines.append(
            f"  loss floor  {_fmt(result.loss_floor)} for these windows (entropy rate {_fmt(result.entropy_rate)});"
            f" val gap to floor {_fmt(result.gap_to_floor, '+.4f')}"
        )
    median = f"; median step {1e3 * result.step_time_p50_s:.1f} ms" if result.step_time_p50_s else ""
    lines.append(f"  throughput  {_fmt(result.tokens_per_s, ',.0f')} tokens/s (training steps only{median})")
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
