"""Which strategies can read a checkpoint, decided before launch from its files alone.

A checkpoint in the universal layout (``checkpoint/universal.py``) resumes under every strategy and world size.
Checkpoints written before that layout was shared kept each strategy's own format: a DDP ``torch.save`` file, a
DeepSpeed ZeRO directory (per-rank partition files). Those still resume, under the strategy that wrote them (and,
for DeepSpeed, on the same number of ranks): anything else is refused here with the way forward, instead of a size
mismatch deep inside a rank.
"""

from __future__ import annotations

from pathlib import Path

from disttrain.config.errors import ConfigError

META_FILE = "meta.pt"  # universal.META_FILE, named here without importing torch


def legacy_writer(checkpoint: Path) -> str | None:
    """The strategy whose own (pre-universal) format ``checkpoint`` is in; None for a universal checkpoint."""
    if checkpoint.is_file():
        return "ddp"
    if (checkpoint / ".metadata").is_file() and (checkpoint / META_FILE).is_file():
        return None
    if (checkpoint / "latest").is_file():
        return "deepspeed"
    return None


def deepspeed_ranks(checkpoint: Path) -> int:
    """How many ranks wrote a DeepSpeed ZeRO checkpoint (one optimizer partition file each)."""
    return len(list(checkpoint.glob("*/*_optim_states.pt")))


def check_strategy_can_read(checkpoint: Path, strategy: str, world_size: int) -> None:
    writer = legacy_writer(checkpoint)
    if writer is None:
        return
    fix = (
        f"resume once with strategy={writer} as the checkpoint was written (its new checkpoints use the universal "
        "layout, which any strategy and world size resumes), or start a new run"
    )
    if strategy != writer:
        raise ConfigError(
            "strategy",
            f"'{checkpoint.name}' is in strategy={writer}'s own pre-universal format, which strategy={strategy} "
            "cannot read",
            fix,
        )
    ranks = deepspeed_ranks(checkpoint) if writer == "deepspeed" else 0
    if ranks and ranks != world_size:
        raise ConfigError(
            "hw.devices_per_node",
            f"'{checkpoint.name}' holds DeepSpeed's own ZeRO partitions of {ranks} ranks; this run has {world_size}",
            f"resume on {ranks} ranks once (its new checkpoints use the universal layout, which any world size "
            "resumes), or start a new run",
        )


def check_same_tokenizer(recorded_sha256: str | None, tokenizer: str | None, current_sha256: str | None) -> None:
    """A resumed run must read its data with the tokenizer the checkpoint was trained with: another one of the same
    size passes every shape check and silently changes what each token id means."""
    if recorded_sha256 is None or current_sha256 is None or recorded_sha256 == current_sha256:
        return
    raise ConfigError(
        "data.tokenizer",
        f"'{tokenizer}' is not the tokenizer the checkpoint's run was trained with (its files differ: sha256 "
        f"{current_sha256[:12]} vs {recorded_sha256[:12]} recorded in that run's run.json)",
        "point data.tokenizer at the tokenizer the run was trained with (token ids would change meaning), or start "
        "a new run",
    )
