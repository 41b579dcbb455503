r"""Where ``python -m train`` spends its training thread's CPU time per step, hook by hook (rank 0).

Runs the job in this process as rank 0 (its other ranks start as usual) with every callback hook, LightningModule
hook and strategy hook timed on the training thread's CPU clock (``time.thread_time``: time waiting for other ranks
or for other processes on a shared machine does not count), and prints each one's milliseconds per optimizer step,
largest first. Nested hooks are each shown with their own total (``optimizer_step`` holds ``training_step`` and
``backward`` under automatic optimization), so the list says where to look, not a sum. A small model makes the
framework's share visible: per-step costs are the same whatever the model.

    python benchmarks/hook_costs.py model.n_layers=2 model.d_model=32 model.n_heads=2 model.ffn_hidden=64 \
        model.seq_len=32 trainer.max_steps=300 diagnostics=off
"""

from __future__ import annotations

import atexit
import collections
import functools
import runpy
import sys
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loops import training_epoch_loop
from lightning.pytorch.trainer import call

TOTALS: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()
STEP = "training loop: one batch (advance)"
HOOKS = [name for name in dir(pl.Callback) if name.startswith("on_")]


def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[key] += time.thread_time() - start
            CALLS[key] += 1

    return wrapper


def time_every_callback(fit: Callable[..., Any]) -> Callable[..., Any]:
    """``Trainer.fit``, after shadowing each callback's hooks with timed ones (instance attributes win)."""

    @functools.wraps(fit)
    def wrapper(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> Any:
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            for hook in HOOKS:
                method = getattr(callback, hook, None)
                if callable(method) and getattr(type(callback), hook) is not getattr(pl.Callback, hook):
                    setattr(callback, hook, timed(f"callback {type(callback).__name__}.{hook}", method))
        return fit(trainer, *args, **kwargs)

    return wrapper


def install() -> None:
    for name in ("_call_lightning_module_hook", "_call_strategy_hook"):
        original = getattr(call, name)
        kind = "module" if "module" in name else "strategy"

        def by_hook(
            trainer: pl.Trainer, hook: str, *args: Any, _original: Any = original, _kind: str = kind, **kw: Any
        ):
            return timed(f"{_kind} {hook}", _original)(trainer, hook, *args, **kw)

        setattr(call, name, by_hook)
    loop = training_epoch_loop._TrainingEpochLoop
    loop.advance = timed(STEP, loop.advance)  # type: ignore[method-assign]
    loop._broadcast_sigterm_tensor = timed("Lightning's per-batch SIGTERM broadcast", loop._broadcast_sigterm_tensor)  # type: ignore[method-assign]
    pl.Trainer.fit = time_every_callback(pl.Trainer.fit)  # type: ignore[method-assign]


def report() -> None:
    batches = CALLS.get(STEP, 0)
    if not batches:
        return
    print(f"\nhook costs on rank 0's training thread, CPU ms per batch over {batches} batches:", file=sys.stderr)
    for key, total in sorted(TOTALS.items(), key=lambda item: -item[1]):
        per_batch = 1e3 * total / batches
        if per_batch >= 0.001:
            print(f"  {per_batch:9.3f}  {key}  ({CALLS[key]} calls)", file=sys.stderr)


if __name__ == "__main__":
    install()
    atexit.register(report)  # the run ends its process itself (launch/process_exit.py), after the exit handlers
    sys.argv = ["train", *sys.argv[1:]]
    runpy.run_module("train", run_name="__main__", alter_sys=True)
