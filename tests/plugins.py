"""A user's own model and datamodule, plugged in by ``_target_`` (docs/configuration.md, "Your own model or data")."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning_projects.classifier import LitClassifier


class BigramModel(nn.Module):
    """Next token from the current one only: tiny, and enough to learn a counting sequence."""

    def __init__(self, vocab_size: int, seq_len: int, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * self.head.weight.numel()


class CountingData(pl.LightningDataModule):
    """Sequences ``k, k+1, ...`` mod ``modulus``: the next token is fully determined by the current one."""

    def __init__(self, seq_len: int, micro_batch_size: int, modulus: int = 10, num_sequences: int = 256) -> None:
        super().__init__()
        starts = torch.arange(num_sequences) % modulus
        windows = (starts[:, None] + torch.arange(seq_len + 1)[None, :]) % modulus
        self.data = TensorDataset(windows[:, :-1], windows[:, 1:])
        self.micro_batch_size = micro_batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.micro_batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.micro_batch_size, drop_last=True)


def _rank() -> int:
    import os

    return int(os.environ.get("LOCAL_RANK", "0"))


class SlowCountingData(CountingData):
    """CountingData whose batches take ``delay_s`` each to produce: an input-bound run."""

    def __init__(self, seq_len: int, micro_batch_size: int, delay_s: float = 0.15) -> None:
        super().__init__(seq_len, micro_batch_size)
        self.delay_s = delay_s

    def train_dataloader(self) -> DataLoader:
        import time

        def slow_collate(items: list) -> tuple[torch.Tensor, torch.Tensor]:
            time.sleep(self.delay_s)
            return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])

        return DataLoader(
            self.data, batch_size=self.micro_batch_size, shuffle=True, drop_last=True, collate_fn=slow_collate
        )


class _SlowItems(torch.utils.data.Dataset):
    """A dataset whose every item takes ``delay_s`` to load (a decode, a read): loader workers parallelize it."""

    def __init__(self, data: TensorDataset, delay_s: float) -> None:
        self.data, self.delay_s = data, delay_s

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        import time

        time.sleep(self.delay_s)
        return self.data[index]


class SlowLoaderData(CountingData):
    """An input-bound datamodule that takes ``num_workers`` (a user's ``+data.num_workers=N`` reaches it)."""

    def __init__(self, seq_len: int, micro_batch_size: int, num_workers: int = 0, delay_s: float = 0.03) -> None:
        super().__init__(seq_len, micro_batch_size)
        self.num_workers, self.delay_s = num_workers, delay_s

    def train_dataloader(self) -> DataLoader:
        items = _SlowItems(self.data, self.delay_s)
        workers = {"num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}
        return DataLoader(items, batch_size=self.micro_batch_size, shuffle=True, drop_last=True, **workers)


class _StuckItems(_SlowItems):
    """Items that block forever from the ``at_item``-th read on (in a loader worker: the rank waits on it)."""

    def __init__(self, data: TensorDataset, at_item: int) -> None:
        super().__init__(data, delay_s=0.0)
        self.at_item, self.reads = at_item, 0

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        if self.reads >= self.at_item:
            import threading

            threading.Event().wait()  # never set
        return super().__getitem__(index)


class StuckLoaderData(CountingData):
    """On local rank ``stuck_rank`` a DataLoader worker blocks forever in ``__getitem__`` (a read never returning)."""

    def __init__(self, seq_len: int, micro_batch_size: int, stuck_rank: int = 1, at_item: int = 40) -> None:
        super().__init__(seq_len, micro_batch_size)
        self.stuck_rank, self.at_item = stuck_rank, at_item

    def train_dataloader(self) -> DataLoader:
        items = _StuckItems(self.data, self.at_item) if _rank() == self.stuck_rank else self.data
        return DataLoader(items, batch_size=self.micro_batch_size, shuffle=True, drop_last=True, num_workers=1)


class SleepyRankModel(BigramModel):
    """BigramModel whose forward sleeps ``sleep_s`` on local rank ``slow_rank``: a straggler DDP hides."""

    def __init__(self, vocab_size: int, seq_len: int, slow_rank: int = 1, sleep_s: float = 0.2) -> None:
        super().__init__(vocab_size, seq_len)
        self.slow = _rank() == slow_rank
        self.sleep_s = sleep_s

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.slow:
            import time

            time.sleep(self.sleep_s)
        return super().forward(tokens)


class WideModel(nn.Module):
    """Many parameters, little compute per token: DDP's all-reduce dominates (comm-bound)."""

    def __init__(self, vocab_size: int, seq_len: int, width: int = 2048, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


class HangingRankModel(BigramModel):
    """Blocks forever in forward on local rank ``stuck_rank`` from the ``at_call``-th forward on."""

    def __init__(self, vocab_size: int, seq_len: int, stuck_rank: int = 1, at_call: int = 5) -> None:
        super().__init__(vocab_size, seq_len)
        self.stuck = _rank() == stuck_rank
        self.at_call = at_call
        self.calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.stuck and self.calls >= self.at_call and self.training:
            import threading

            threading.Event().wait()  # never set: this rank hangs outside any collective
        return super().forward(tokens)


class InfAtStepModel(BigramModel):
    """BigramModel whose logits are +inf on local rank ``inf_rank`` at the given training steps (0-based).

    The loss of those steps is NaN on that rank only, so the other ranks see a non-finite value only through
    the gradient all-reduce (DDP) or not at all (FSDP shards): what the non-finite guard's vote is for.
    """

    def __init__(self, vocab_size: int, seq_len: int, inf_steps: list[int] | None = None, inf_rank: int = 1) -> None:
        super().__init__(vocab_size, seq_len)
        self.inf_steps = set(inf_steps or [])
        self.active = _rank() == inf_rank
        self.training_calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = super().forward(tokens)
        if not self.training:
            return logits
        step, self.training_calls = self.training_calls, self.training_calls + 1
        if self.active and step in self.inf_steps:
            return logits + float("inf")
        return logits


class BigramModelWithCredentials(BigramModel):
    """A model whose factory takes credentials (as one that downloads weights would): they must never be saved."""

    def __init__(self, vocab_size: int, seq_len: int, api_token: str = "", note: str = "") -> None:
        super().__init__(vocab_size, seq_len)
        self.has_credentials = bool(api_token or note)


class RaisingRankModel(BigramModel):
    """BigramModel raising ``ValueError`` in its ``at_call``-th training forward on local rank ``raise_rank``: a user's
    bug that hits one rank only, while the others go on into the next collective."""

    def __init__(self, vocab_size: int, seq_len: int, raise_rank: int = 1, at_call: int = 4) -> None:
        super().__init__(vocab_size, seq_len)
        self.raises = _rank() == raise_rank
        self.at_call = at_call
        self.calls = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.raises and self.calls >= self.at_call:
                raise ValueError(f"bad batch in training forward {self.calls} (deliberate)\nsecond line of the message")
        return super().forward(tokens)


# -- a slow rank in every phase, one after another (tests/dist/test_diagnostics_ranks.py) -------------------------
SLOW_PHASES = ("data", "forward", "backward", "optimizer", "other")
PHASE_SLEEP_S = 0.08  # several times a step of BigramModel: far above scheduling noise on a shared CPU
PHASE_SEGMENT_STEPS = 8
PHASE_FIRST_STEP = 6  # after the warm-up steps the analysis drops anyway


def phase_plan() -> list[tuple[str, int, int, int]]:
    """(phase, slow rank, first step, last step) of each segment, steps counted from 0 by optimizer steps taken.

    The telemetry numbers a step by ``global_step`` after it, so segment steps [a, b] are records a+1 .. b+1.
    """
    plan, step = [], PHASE_FIRST_STEP
    for phase in SLOW_PHASES:
        for rank in (0, 1):
            plan.append((phase, rank, step, step + PHASE_SEGMENT_STEPS - 1))
            step += PHASE_SEGMENT_STEPS
    return plan


class _PhaseClock:
    """This process's optimizer steps so far (a global optimizer hook) and the sleep the plan asks for now."""

    steps = 0
    installed = False

    @classmethod
    def install(cls) -> None:
        if cls.installed:
            return
        cls.installed = True

        def after_step(*_: object) -> None:
            # Not a pre-hook: Lightning's optimizer.step(closure) runs the hooks before the closure (forward and
            # backward); after the update is the optimizer phase as the step timer sees it.
            cls.delay("optimizer")
            cls.steps += 1

        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(after_step)

    @classmethod
    def delay(cls, phase: str) -> None:
        import time

        rank = _rank()
        for name, slow_rank, first, last in phase_plan():
            if name == phase and slow_rank == rank and first <= cls.steps <= last:
                time.sleep(PHASE_SLEEP_S)


class PhaseSlowModel(BigramModel):
    """BigramModel whose rank sleeps in forward, at the start of backward, or before the optimizer step when
    ``phase_plan()`` says so (data and the time between steps: ``PhaseSlowData``)."""

    def __init__(self, vocab_size: int, seq_len: int) -> None:
        super().__init__(vocab_size, seq_len)
        _PhaseClock.install()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.training:
            _PhaseClock.delay("forward")
        logits = super().forward(tokens)
        if self.training and logits.requires_grad:
            logits.register_hook(lambda _: _PhaseClock.delay("backward"))  # the first thing backward runs
        return logits


class PhaseSlowData(CountingData):
    """CountingData whose rank is slow to produce a batch (data) or to hand it over (other), by ``phase_plan()``."""

    def train_dataloader(self) -> DataLoader:
        def collate(items: list) -> tuple[torch.Tensor, torch.Tensor]:
            _PhaseClock.delay("data")
            return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])

        return DataLoader(self.data, batch_size=self.micro_batch_size, shuffle=True, drop_last=True, collate_fn=collate)

    def on_after_batch_transfer(self, batch: object, dataloader_idx: int) -> object:
        # Runs after the batch is fetched and before the step's forward: time no phase timer covers ("other").
        if self.trainer is not None and self.trainer.training:
            _PhaseClock.delay("other")
        return batch


class SlowTeardownData(CountingData):
    """CountingData whose teardown takes ``delay_s`` on global rank 0: the launcher is still ending ``fit`` when
    the other ranks have finished theirs (the order a rank-0-only teardown, such as a slow logger, gives)."""

    def __init__(self, seq_len: int, micro_batch_size: int, delay_s: float = 3.0) -> None:
        super().__init__(seq_len, micro_batch_size)
        self.delay_s = delay_s

    def teardown(self, stage: str) -> None:
        if _rank() == 0:
            import time

            time.sleep(self.delay_s)


class DictLogitsModel(BigramModel):
    """A model that returns an output object (as HF models do) instead of the logits tensor."""

    def forward(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return {"logits": super().forward(tokens)}


class PooledLogitsModel(BigramModel):
    """One row of logits per sequence, not per token (a classifier's head)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens).mean(dim=1)


class DictBatchData(CountingData):
    """CountingData whose batches are dicts (an HF-style collator's), not the (inputs, targets) pairs runs read."""

    def train_dataloader(self) -> DataLoader:
        rows = [{"input_ids": x, "labels": y} for x, y in self.data]
        return DataLoader(rows, batch_size=self.micro_batch_size, drop_last=True)  # type: ignore[arg-type]


class SleepyRankClassifier(LitClassifier):
    """The plain Lightning classifier whose training_step sleeps ``sleep_s`` on local rank ``slow_rank`` before its
    forward: a straggler inside a user's own LightningModule."""

    def __init__(self, net: nn.Module, slow_rank: int = 1, sleep_s: float = 0.05, **kwargs: float) -> None:
        super().__init__(net, **kwargs)
        self.slow = _rank() == slow_rank
        self.sleep_s = sleep_s

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.slow and self.training:
            import time

            time.sleep(self.sleep_s)
        return super().forward(images)
