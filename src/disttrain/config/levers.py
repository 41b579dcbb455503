"""The trainer's lever catalogue: every config key a recommendation may set, its class and what it changes.

One list serves both sides of the run dir: ``tune`` classifies a recommendation's override by it (tune/levers.py),
and run.json records it (``levers``) so a report rendered from a copied run dir, without this package, knows which
keys this trainer took as levers and whether each keeps the training math. A class in ``PRESERVING`` changes how
a step is computed, not what it computes; every other class changes what the optimizer sees. A key not listed is
treated as changing the math: nothing guesses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PRESERVING = (
    "loader",
    "buckets",
    "comm_hook",
    "checkpointing",
    "resharding",
    "compile",
    "logging",
    "micro_batch",
    "layout",
)


@dataclass(frozen=True)
class ConfigLever:
    key: str  # the config key an override sets (without Hydra's ``+``/``~``)
    lever: str  # its class: one of PRESERVING, or one that changes the math
    changes: str  # one line: what setting it changes in the run

    @property
    def keeps_math(self) -> bool:
        return self.lever in PRESERVING


CATALOGUE = (
    ConfigLever("data.num_workers", "loader", "loader worker processes per rank"),
    ConfigLever("data.pin_memory", "loader", "page-locked host batches for the copy to the device"),
    ConfigLever("data.prefetch_factor", "loader", "batches each loader worker prepares ahead"),
    ConfigLever("strategy.bucket_cap_mb", "buckets", "DDP's gradient bucket size"),
    ConfigLever("strategy.reduce_bucket_size", "buckets", "ZeRO's gradient reduction bucket size"),
    ConfigLever("strategy.overlap_comm", "buckets", "ZeRO's gradient reduction overlapped with backward"),
    ConfigLever("strategy.comm_hook", "comm_hook", "how DDP's gradients travel (compressed or not)"),
    ConfigLever("strategy.powersgd_rank", "comm_hook", "PowerSGD's low-rank approximation rank"),
    ConfigLever("strategy.powersgd_warmup_steps", "comm_hook", "steps of exact all-reduce before PowerSGD"),
    ConfigLever("strategy.activation_checkpointing", "checkpointing", "activations recomputed in backward"),
    ConfigLever("strategy.reshard_after_forward", "resharding", "FSDP's parameters freed after forward"),
    ConfigLever("strategy.stage", "resharding", "which model states ZeRO shards"),
    ConfigLever("strategy.cpu_offload", "resharding", "FSDP's parameters and gradients kept on the host"),
    ConfigLever("strategy.offload_optimizer", "resharding", "ZeRO's optimizer states kept on the host"),
    ConfigLever("model.compile", "compile", "the model compiled by torch.compile"),
    ConfigLever("trainer.log_every_n_steps", "logging", "how often the run logs"),
    ConfigLever("trainer.micro_batch_size", "micro_batch", "samples per micro-batch (accumulation follows)"),
    ConfigLever("strategy", "layout", "the data-parallel or 3D strategy"),
    ConfigLever("strategy.tp", "layout", "tensor-parallel degree"),
    ConfigLever("strategy.pp", "layout", "pipeline-parallel degree"),
    ConfigLever("strategy.microbatches", "layout", "micro-batches per pipeline step"),
    ConfigLever("strategy.schedule", "layout", "the pipeline schedule"),
    ConfigLever("strategy.virtual_stages", "layout", "pipeline stages per rank (interleaving)"),
    ConfigLever("trainer.global_batch_size", "global_batch", "samples per optimizer step"),
    ConfigLever("precision", "precision", "the precision recipe"),
    ConfigLever("trainer.val_every_n_steps", "pauses", "how often the run validates"),
    ConfigLever("trainer.ckpt_every_n_steps", "pauses", "how often the run saves a checkpoint"),
    # Levers the diagnosis recommends that no class here is known to keep the math of ("other"): tried only when
    # ``tune.allow`` names it.
    ConfigLever("optimizer", "other", "the optimizer"),
    ConfigLever("optimizer.lr", "other", "the peak learning rate"),
    ConfigLever("optimizer.warmup_steps", "other", "the learning-rate warm-up"),
    ConfigLever("trainer.grad_clip", "other", "the gradient-norm clip"),
    ConfigLever("trainer.nan_policy", "other", "what a non-finite step does (skip, stop)"),
    ConfigLever("model.compile_mode", "other", "torch.compile's mode"),
    ConfigLever("model.aux_loss_coef", "other", "the experts' load-balancing loss weight"),
    ConfigLever("model.capacity_factor", "other", "tokens each expert takes, over an even share"),
    ConfigLever("strategy.ep", "other", "expert-parallel degree"),
    ConfigLever("strategy.expert_placement", "other", "which ranks hold which experts"),
    ConfigLever("strategy.reduce_dtype", "other", "the dtype gradients are reduced in"),
    ConfigLever("resume", "other", "the checkpoint the run starts from"),
)
BY_KEY = {lever.key: lever for lever in CATALOGUE}


def catalogue_record() -> list[dict[str, Any]]:
    """The catalogue as run.json holds it: one ``{key, lever, changes, keeps_math}`` per key."""
    return [
        {"key": lever.key, "lever": lever.lever, "changes": lever.changes, "keeps_math": lever.keeps_math}
        for lever in CATALOGUE
    ]
