"""Injected bottlenecks for ``benchmarks/diagnosis_accuracy.py``: a model and a datamodule plugged in by ``_target_``.

Each injection holds chosen local ranks in one phase of the step (data, forward, backward, optimizer), asleep or
computing (``work``: a wait on I/O, or more work / a slower core), or sends DDP's gradient all-reduce over an emulated
slow link (``link_bytes_per_s``: a delay per collective in proportion to the bytes it sends, on top of whichever
``strategy.comm_hook`` the run uses), switched off by its own argument,
so a scenario's counterfactual is the same command with the fault off. The communication counterfactual keeps
every rank's gradients local (``local_grads=true``): the same per-rank work without the gradient all-reduce.
All of it is benchmark-only: nothing here is imported by the product.

No ``from __future__ import annotations``: DDP inspects a comm hook's signature and refuses string annotations.
"""

import os
import time
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WORK = ("sleep", "compute")


def hold(seconds: float, work: str = "sleep") -> None:
    """Hold this thread for ``seconds``: ``sleep`` waits (I/O, a remote store: the core is free meanwhile);
    ``compute`` spends ``seconds`` of this thread's CPU on matmuls, as a rank with more work or a slower core does.
    Compute is a fixed amount of CPU, not of wall time: on a contended box it stretches, as real work does. The
    matmuls release the GIL as torch's kernels do, and are few (~0.2 ms each on this box): the profiler window
    records every op, and tens of thousands of tiny ones made its step seconds long, a cost of the injection.
    """
    if work == "sleep":
        time.sleep(seconds)
        return
    if work != "compute":
        raise ValueError(f"work: unknown kind {work!r}; use one of {', '.join(WORK)}")
    a, b = torch.rand(192, 192), torch.rand(192, 192)
    out = torch.empty(192, 192)
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        torch.mm(a, b, out=out)


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_slow_here(slow_ranks: list[int] | None) -> bool:
    """``None`` slows every rank; a list slows only those local ranks."""
    return slow_ranks is None or local_rank() in slow_ranks


def local_gradient_hook(state, bucket):  # no annotations: DDP reads the signature
    """A DDP comm hook that returns this rank's own gradient bucket unreduced: no collective at all."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def use_ddp_comm_hook(hook: Callable, state: object = None) -> None:
    """Make DDP register ``hook`` in this process, whatever ``strategy.comm_hook`` says.

    Replaces the strategy's hook registration in this rank's process only (each rank is its own
    ``python -m train``): the product's code and config are unchanged, and a run without ``local_grads``
    never calls this.
    """
    from disttrain.strategies.ddp import HookedDDPStrategy

    def register(self: HookedDDPStrategy) -> None:
        self.model.register_comm_hook(state=state, hook=hook)

    HookedDDPStrategy._register_ddp_hooks = register  # type: ignore[method-assign]


class SlowLink:
    """An emulated link of ``bytes_per_s``: every all-reduce hands its tensor's bytes over it, so it ends
    ``bytes / bytes_per_s`` seconds later than the real collective.

    The delay is per collective, on the bytes the collective is actually given: a comm hook that compresses
    (bf16/fp16 halve the bytes, PowerSGD sends two low-rank factors) genuinely shortens it, and a bigger bucket
    pays in proportion, as on a real slow network. torch's DDP hooks and PowerSGD issue their collectives as
    ``torch.distributed.all_reduce``, the call ``metered`` wraps. Only the gradients cross the link: the
    all-reduces issued while a comm hook ``carrying`` wraps is running (the run's other collectives, the
    non-finite guard's vote or the bandwidth probe, keep their speed, as before the link composed with hooks).
    A count shared by all threads, not a thread-local flag: PowerSGD issues its later all-reduces from gloo's
    threads, while its hook waits for them (one bucket at a time on gloo, ``disttrain.strategies.powersgd``).
    """

    def __init__(self, bytes_per_s: float, sleep: Callable[[float], None] = time.sleep) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"data.link_bytes_per_s: must be > 0 bytes/s, got {bytes_per_s:g}")
        self.bytes_per_s = bytes_per_s
        self.sleep = sleep
        self.hooks_running = 0

    def delay_s(self, tensor: torch.Tensor) -> float:
        return tensor.numel() * tensor.element_size() / self.bytes_per_s

    def carrying(self, hook: Callable) -> Callable:
        """``hook`` (a DDP comm hook) whose all-reduces cross the link."""

        def over_link(state, bucket):  # no annotations: DDP reads the signature
            self.hooks_running += 1
            try:
                return hook(state, bucket)
            finally:
                self.hooks_running -= 1

        return over_link

    def metered(self, all_reduce: Callable, sent: Callable[[tuple], torch.Tensor] | None = None) -> Callable:
        """``all_reduce`` (or another collective) whose result arrives ``delay_s(tensor)`` later; ``sent`` picks
        the tensor whose bytes cross the link from the call's arguments (default: the first, all-reduce's).

        An async collective's delay runs in its future's callback (gloo's thread), as before the hook's own
        callbacks: it overlaps the rest of the backward, and what is left is exposed at its end, as a slow
        network's transfer would be.
        """

        def slow_all_reduce(tensor: torch.Tensor, *args, **kwargs):
            payload = tensor if sent is None else sent((tensor, *args))
            seconds = self.delay_s(payload) if self.hooks_running else 0.0
            work = all_reduce(tensor, *args, **kwargs)
            if not seconds:
                return work
            if work is None:  # a blocking call has finished its transfer
                self.sleep(seconds)
                return None
            return _DelayedWork(work, seconds, self.sleep)

        return slow_all_reduce


class _DelayedWork:
    """A collective's work handle whose completion comes ``seconds`` after the real one's."""

    def __init__(self, work: object, seconds: float, sleep: Callable[[float], None]) -> None:
        self.work, self.seconds, self.sleep = work, seconds, sleep

    def get_future(self) -> torch.futures.Future:
        def after_transfer(future: torch.futures.Future):
            self.sleep(self.seconds)
            return future.value()

        return self.work.get_future().then(after_transfer)

    def wait(self, *args, **kwargs):
        done = self.work.wait(*args, **kwargs)
        self.sleep(self.seconds)
        return done

    def __getattr__(self, name: str):
        return getattr(self.work, name)


def slow_down_gradient_link(link: SlowLink) -> None:
    """DDP's gradient all-reduces go over ``link``: DDP reduces its gradients through a Python comm hook, carried
    by the link: the one ``strategy.comm_hook`` selects, else torch's plain all-reduce hook (DDP's own
    all-reduce runs in C++, out of the link's reach). The strategy's registration is kept (PowerSGD's state
    binding, checkpointing): the link composes with whatever hook the config chose.
    """
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from disttrain.strategies.ddp import HookedDDPStrategy

    dist.all_reduce = link.metered(dist.all_reduce)
    carry_onebit_exchange(link)
    register_chosen = HookedDDPStrategy._register_ddp_hooks

    def register(self: HookedDDPStrategy) -> None:
        if self._ddp_comm_hook is None:
            self._ddp_comm_state, self._ddp_comm_hook = None, default_hooks.allreduce_hook
        self._ddp_comm_hook = link.carrying(self._ddp_comm_hook)
        register_chosen(self)

    HookedDDPStrategy._register_ddp_hooks = register  # type: ignore[method-assign]


def carry_onebit_exchange(link: SlowLink) -> None:
    """``optimizer=onebit_adam`` sends its momentum from the optimizer step, not from DDP's hook: its exchange's
    all-to-all and all-gather cross the link too, each metered by what a rank sends in a 2-rank world (half of the
    all-to-all's input goes to the other rank; the all-gather sends its whole input), as the all-reduce is by its
    buffer (what a 2-rank ring sends)."""
    import torch.distributed as dist

    from disttrain.strategies.onebit import CompressedMean

    def half(args: tuple) -> torch.Tensor:
        return args[1].reshape(-1)[: args[1].numel() // 2]

    dist.all_to_all_single = link.metered(dist.all_to_all_single, sent=half)
    dist.all_gather_into_tensor = link.metered(dist.all_gather_into_tensor, sent=lambda args: args[1])
    exchange = CompressedMean.__call__

    def over_link(self: CompressedMean, flat: torch.Tensor) -> torch.Tensor:
        link.hooks_running += 1
        try:
            return exchange(self, flat)
        finally:
            link.hooks_running -= 1

    CompressedMean.__call__ = over_link  # type: ignore[method-assign]


_optimizer_sleep: dict[str, object] = {}


def sleep_in_optimizer_step(sleep_s: float, slow_ranks: list[int] | None, every: int = 1, work: str = "sleep") -> None:
    """Every optimizer step on ``slow_ranks`` ends held for ``sleep_s`` (``hold``; a global torch optimizer hook).

    A post-step hook, not a pre-step one: Lightning runs forward and backward in the closure that
    ``optimizer.step`` calls, so a pre-step sleep would land before the forward.

    Registered once per process although a model may be built more than once (on the meta device for its
    parameter count, then for real); the rank is read when the step runs, after the launcher has set it.
    """
    from torch.optim.optimizer import register_optimizer_step_post_hook

    if not _optimizer_sleep:
        register_optimizer_step_post_hook(_sleep_after_step)
    _optimizer_sleep.update(sleep_s=sleep_s, slow_ranks=slow_ranks, every=every, steps=0, work=work)


def _sleep_after_step(optimizer: object, args: object, kwargs: object) -> None:
    _optimizer_sleep["steps"] += 1  # type: ignore[operator]
    if _optimizer_sleep["steps"] % _optimizer_sleep["every"]:  # type: ignore[operator]
        return
    if is_slow_here(_optimizer_sleep["slow_ranks"]):  # type: ignore[arg-type]
        hold(_optimizer_sleep["sleep_s"], _optimizer_sleep["work"])  # type: ignore[arg-type]


class RandomTokens(pl.LightningDataModule):
    """Uniform random tokens whose batches take ``delay_s`` each to produce on ``slow_ranks`` (None: all).

    ``optimizer_sleep_s`` slows the optimizer step of ``slow_ranks`` instead, and ``link_bytes_per_s`` makes
    DDP's gradient all-reduce as slow as over a link of that bandwidth (set here so that a built-in model can
    carry the fault); ``local_grads`` is the communication counterfactual (see ``local_gradient_hook``). ``work``:
    the delays sleep or compute (``hold``).
    """

    def __init__(
        self,
        seq_len: int,
        micro_batch_size: int,
        vocab_size: int = 256,
        delay_s: float = 0.0,
        optimizer_sleep_s: float = 0.0,
        slow_ranks: list[int] | None = None,
        local_grads: bool = False,
        link_bytes_per_s: float = 0.0,
        num_sequences: int = 2048,
        stall_every: int = 1,
        num_workers: int = 0,
        work: str = "sleep",
    ) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab_size, (num_sequences, seq_len + 1), generator=generator)
        self.data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
        self.micro_batch_size = micro_batch_size
        self.delay_s = delay_s
        self.slow_ranks = slow_ranks
        self.stall_every = stall_every  # the delay only on every N-th batch: an intermittent stall
        self.num_workers = num_workers  # loader processes: the lever of an input-bound run (tune_accuracy.py)
        if work not in WORK:
            raise ValueError(f"data.work: unknown kind {work!r}; use one of {', '.join(WORK)}")
        self.work = work
        if optimizer_sleep_s:
            sleep_in_optimizer_step(optimizer_sleep_s, slow_ranks, stall_every, work)
        if local_grads:
            use_ddp_comm_hook(local_gradient_hook)
        elif link_bytes_per_s:
            slow_down_gradient_link(SlowLink(link_bytes_per_s))

    def train_dataloader(self) -> DataLoader:
        delay_s = self.delay_s if is_slow_here(self.slow_ranks) else 0.0
        batches = [0]

        def collate(items: list) -> tuple[torch.Tensor, torch.Tensor]:
            batches[0] += 1
            if delay_s and batches[0] % self.stall_every == 0:
                hold(delay_s, self.work)
            return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])

        workers = {"num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}
        return DataLoader(
            self.data, batch_size=self.micro_batch_size, shuffle=True, drop_last=True, collate_fn=collate, **workers
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.micro_batch_size, drop_last=True)


class SleepInBackward(torch.autograd.Function):
    """Identity whose backward is held (``hold``): a rank that is slow in its backward pass."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sleep_s: float, work: str) -> torch.Tensor:
        ctx.sleep_s, ctx.work = sleep_s, work
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        hold(ctx.sleep_s, ctx.work)
        return grad, None, None


def held_now(module: nn.Module) -> bool:
    """Whether this training call of ``module`` (an injected model: ``sleep_s``, ``slow_ranks``, ``stall_every``,
    ``calls``) is one its fault holds; a forward fault is held here. The rank is read at the call, not at
    construction: the launcher builds the model once before it knows its rank."""
    module.calls += module.training
    slow = module.training and module.sleep_s > 0 and is_slow_here(module.slow_ranks)
    slow = slow and module.calls % module.stall_every == 0
    if slow and module.phase == "forward":
        hold(module.sleep_s, module.work)
    return slow


class InjectedModel(nn.Module):
    """An MLP language model (``blocks`` for FSDP) held ``sleep_s`` in ``phase`` on ``slow_ranks``.

    ``phase`` is forward, backward or optimizer; ``sleep_s=0`` is the healthy counterfactual; ``work``: asleep or
    computing (``hold``).
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        width: int = 256,
        depth: int = 4,
        phase: str = "forward",
        sleep_s: float = 0.0,
        slow_ranks: list[int] | None = None,
        local_grads: bool = False,
        stall_every: int = 1,
        work: str = "sleep",
    ) -> None:
        super().__init__()
        if phase not in ("forward", "backward", "optimizer"):
            raise ValueError(f"model.phase: unknown phase {phase!r}; use forward, backward or optimizer")
        if work not in WORK:
            raise ValueError(f"model.work: unknown kind {work!r}; use one of {', '.join(WORK)}")
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))
        self.head = nn.Linear(width, vocab_size)
        self.phase, self.sleep_s, self.slow_ranks, self.work = phase, sleep_s, slow_ranks, work
        self.stall_every, self.calls = stall_every, 0  # sleep only in every N-th training forward: a stall
        if sleep_s and phase == "optimizer":
            sleep_in_optimizer_step(sleep_s, slow_ranks, stall_every, work)
        if local_grads:
            use_ddp_comm_hook(local_gradient_hook)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        slow = held_now(self)
        h = self.embed(tokens)
        if slow and self.phase == "backward":
            h = SleepInBackward.apply(h, self.sleep_s, self.work)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * sum(p.numel() for name, p in self.named_parameters() if not name.startswith("embed"))


class InjectedLightningModule(pl.LightningModule):
    """A user's own LightningModule, written as a user writes one (its training_step logs its loss with
    ``sync_dist=True``: a reduce inside the step), held ``sleep_s`` in ``phase`` on ``slow_ranks`` like
    ``InjectedModel``. ``net``: ``conv`` (a conv-net image classifier, SGD with momentum) or ``embed`` (an
    embedding-table recommender over (user, item) ids, Adam): the two generic cells of the diagnosis matrix."""

    def __init__(
        self,
        net: str = "conv",
        phase: str = "forward",
        sleep_s: float = 0.0,
        slow_ranks: list[int] | None = None,
        stall_every: int = 1,
        work: str = "sleep",
        local_grads: bool = False,
    ) -> None:
        super().__init__()
        if phase not in ("forward", "backward", "optimizer"):
            raise ValueError(f"model.phase: unknown phase {phase!r}; use forward, backward or optimizer")
        if net == "conv":
            self.body = nn.Sequential(
                nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
            )  # fmt: skip
        elif net == "embed":
            self.users, self.items = nn.Embedding(IDS, 64), nn.Embedding(IDS, 64)
            for table in (self.users, self.items):
                nn.init.normal_(table.weight, std=0.1)  # dot products of unit scale
        else:
            raise ValueError(f"model.net: unknown {net!r}; use conv or embed")
        self.net, self.phase, self.sleep_s, self.slow_ranks, self.work = net, phase, sleep_s, slow_ranks, work
        self.stall_every, self.calls = stall_every, 0
        if sleep_s and phase == "optimizer":
            sleep_in_optimizer_step(sleep_s, slow_ranks, stall_every, work)
        if local_grads:
            use_ddp_comm_hook(local_gradient_hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slow = held_now(self)
        if self.net == "conv":
            h = self.body[0](x)
            if slow and self.phase == "backward":
                h = SleepInBackward.apply(h, self.sleep_s, self.work)
            return self.body[1:](h)
        user = self.users(x[:, 0])
        if slow and self.phase == "backward":
            user = SleepInBackward.apply(user, self.sleep_s, self.work)
        return (user * self.items(x[:, 1])).sum(-1)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = self(x)
        return nn.functional.cross_entropy(out, y) if self.net == "conv" else nn.functional.mse_loss(out, y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.net == "conv":
            return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)
        return torch.optim.Adam(self.parameters(), lr=0.01)


IDS = 16384  # rows of each of the recommender's two embedding tables: 2.1M parameters


class InjectedSamples(RandomTokens):
    """``RandomTokens``'s injections (loader delays, optimizer sleeps, the local-gradient counterfactual) over a
    LightningModule's own samples: 1 x 16 x 16 images with class labels (``net=conv``) or (user, item) id pairs with
    ratings (``net=embed``); the run's micro-batch arrives as ``batch_size``."""

    def __init__(self, batch_size: int, net: str = "conv", num_samples: int = 4096, **injections: object) -> None:
        super().__init__(seq_len=1, micro_batch_size=batch_size, num_sequences=1, **injections)  # type: ignore[arg-type]
        generator = torch.Generator().manual_seed(0)
        if net == "conv":
            labels = torch.randint(0, 10, (num_samples,), generator=generator)
            templates = torch.randn(10, 1, 16, 16, generator=generator)
            images = templates[labels] + torch.randn(num_samples, 1, 16, 16, generator=generator)
            self.data = TensorDataset(images, labels)
        else:
            ids = torch.randint(0, 512, (num_samples, 2), generator=generator)
            self.data = TensorDataset(ids, torch.randn(num_samples, generator=generator))
