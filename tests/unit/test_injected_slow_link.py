"""The emulated slow link of benchmarks/injected.py (``+data.link_bytes_per_s``): its delay follows the bytes the
run's own comm hook hands to the collective, so a compressing hook (the tune's lever) genuinely shortens it.

A one-process gloo group (no launches): DDP still runs its comm hook on every bucket. The link's sleep is recorded,
not timed: the delays are exact byte counts over the rate.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from benchmarks.injected import SlowLink, slow_down_gradient_link
from disttrain.config.strategy_schema import DDPConfig
from disttrain.strategies.comm_hooks import build_comm_hook
from disttrain.strategies.ddp import HookedDDPStrategy
from disttrain.strategies.onebit import CompressedMean

RATE = 1e6  # bytes/s
WEIGHTS = ((64, 128), (128, 32))  # (in, out) of each Linear: weight out x in, bias out
NUMEL = sum(i * o + o for i, o in WEIGHTS)
WARMUP = 2  # PowerSGD's plain all-reduce steps (torch's minimum with error feedback)


@contextmanager
def one_rank_group(store: Path) -> Iterator[None]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def keep_patched_functions_for_the_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recorded so that the test's end restores them: the injection patches the process, as in a rank of a run."""
    for name in ("all_reduce", "all_to_all_single", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, getattr(dist, name))
    monkeypatch.setattr(HookedDDPStrategy, "_register_ddp_hooks", HookedDDPStrategy._register_ddp_hooks)
    monkeypatch.setattr(CompressedMean, "__call__", CompressedMean.__call__)


def delays_per_step(hook_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int) -> list[float]:
    """The link's total delay in each of ``steps`` backward passes of a 2-layer DDP model using ``hook_name``."""
    slept: list[float] = []
    keep_patched_functions_for_the_test(monkeypatch)
    slow_down_gradient_link(SlowLink(RATE, sleep=slept.append))
    cfg = DDPConfig(comm_hook=hook_name, powersgd_rank=1, powersgd_warmup_steps=WARMUP)
    state, hook = build_comm_hook(cfg, "gloo")
    per_step = []
    with one_rank_group(tmp_path / "store"):
        torch.manual_seed(0)
        model = DistributedDataParallel(nn.Sequential(*(nn.Linear(i, o) for i, o in WEIGHTS)))
        # The strategy's own registration, as Lightning calls it once the model is wrapped (PowerSGD binds here).
        strategy = SimpleNamespace(model=model, _ddp_comm_state=state, _ddp_comm_hook=hook)
        HookedDDPStrategy._register_ddp_hooks(strategy)  # type: ignore[arg-type]
        for _ in range(steps):
            slept.clear()
            model(torch.randn(4, WEIGHTS[0][0])).sum().backward()
            per_step.append(sum(slept))
        # DDP's reducer must go before its process group: freed after it, its threads deadlock at teardown.
        del model, strategy
        gc.collect()
    return per_step


def test_the_link_delays_every_collective_of_a_comm_hook_by_its_own_bytes() -> None:
    slept: list[float] = []
    link = SlowLink(RATE, sleep=slept.append)
    blocking = link.metered(lambda tensor, *args, **kwargs: None)
    hook = link.carrying(lambda state, tensors: [blocking(t) for t in tensors])
    hook(None, [torch.zeros(1000), torch.zeros(1000, dtype=torch.bfloat16)])  # fp32, then bf16
    assert slept == [pytest.approx(4000 / RATE), pytest.approx(2000 / RATE)]
    blocking(torch.zeros(1000))  # outside a comm hook (a metric's or a probe's all-reduce): not over the link
    assert len(slept) == 2 and link.hooks_running == 0
    with pytest.raises(ValueError, match=r"data.link_bytes_per_s: must be > 0"):
        SlowLink(0.0)


@pytest.mark.parametrize(("hook", "bytes_per_value"), [("none", 4), ("bf16", 2), ("fp16", 2)])
def test_the_delay_is_the_bytes_the_chosen_hook_sends(
    hook: str, bytes_per_value: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No hook configured: DDP's gradients still cross the link (torch's plain all-reduce hook), in fp32.
    (delay,) = delays_per_step(hook, tmp_path, monkeypatch, steps=1)
    assert delay * RATE == pytest.approx(NUMEL * bytes_per_value)


def test_powersgd_shortens_the_link_to_its_low_rank_factors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    delays = delays_per_step("powersgd", tmp_path, monkeypatch, steps=WARMUP + 2)
    # Warm-up: plain fp32 all-reduce. Then, per weight matrix (out x in), P (out x 1) and Q (in x 1) at rank 1,
    # plus the uncompressed biases: 160 + 160 + 192 values instead of 12,448.
    assert [d * RATE for d in delays[:WARMUP]] == [pytest.approx(NUMEL * 4)] * WARMUP
    biases = sum(o for _, o in WEIGHTS)
    factors = sum(o + i for i, o in WEIGHTS)
    assert [d * RATE for d in delays[WARMUP:]] == [pytest.approx((biases + factors) * 4)] * 2
    assert delays[-1] < delays[0] / 20


def blocking_copy(out: torch.Tensor, inp: torch.Tensor, group: object = None) -> None:
    """A blocking collective of a 2-rank world whose other rank sent the same bytes as this one."""
    out.copy_(inp.reshape(-1).repeat(out.numel() // inp.numel()).view_as(out))


def test_onebit_adams_exchange_crosses_the_link_with_what_a_rank_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    # A 2-rank world faked in this process: the collectives copy what the other rank would have sent back.
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_to_all_single", blocking_copy)
    monkeypatch.setattr(dist, "all_gather_into_tensor", blocking_copy)
    keep_patched_functions_for_the_test(monkeypatch)
    slept: list[float] = []
    slow_down_gradient_link(SlowLink(RATE, sleep=slept.append))
    mean = CompressedMean(NUMEL, torch.device("cpu"))
    mean(torch.randn(NUMEL))
    # Half the all-to-all's input goes to the other rank; the all-gather sends this rank's chunk: the compressed
    # buffer once, a thirtieth of the fp32 all-reduce's bytes.
    assert sum(slept) * RATE == pytest.approx(mean.bytes_per_phase)
    assert len(slept) == 2 and mean.bytes_per_phase < NUMEL * 4 / 25
    blocking_copy_over_link = dist.all_gather_into_tensor
    blocking_copy_over_link(torch.zeros(4), torch.zeros(2))  # outside the exchange: not over the link
    assert len(slept) == 2
