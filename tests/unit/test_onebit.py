"""1-bit Adam's pieces in one process: sign packing, the block scale, error feedback, the compressed mean's
arithmetic and payload, and the optimizer (AdamW until its freeze, then the frozen variance)."""

from __future__ import annotations

import pytest
import torch

from disttrain.models.onebit_adam import OneBitAdam
from disttrain.strategies.onebit import (
    BLOCK,
    CompressedMean,
    OneBitComm,
    compress,
    compress_with_feedback,
    decompress,
    pack_signs,
    unpack_signs,
)


@pytest.mark.parametrize("seed", range(4))
def test_signs_round_trip_through_eight_to_a_byte(seed: int) -> None:
    x = torch.randn(3, 8 * (seed + 1), generator=torch.Generator().manual_seed(seed))
    x[0, 0] = 0.0  # zero counts as positive
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, seed + 1)
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs(packed), expected)


@pytest.mark.parametrize("seed", range(4))
def test_a_compressed_block_keeps_its_norm(seed: int) -> None:
    x = torch.randn(5, BLOCK, generator=torch.Generator().manual_seed(seed)) * torch.rand(5, 1) * 10
    signs, scales = compress(x)
    assert scales.shape == (5,) and signs.shape == (5, BLOCK // 8)
    assert torch.allclose(decompress(signs, scales).norm(dim=-1), x.norm(dim=-1), rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_error_feedback_stays_bounded_and_loses_nothing_over_time(seed: int) -> None:
    # Compressing the same vector again and again (the hardest input for signs: the large values never flip): each
    # output alone is 1 bit a value, but their running mean converges to the vector, because the error carries
    # what each output lacked (mean = x - error / k), and the error stops growing.
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, BLOCK, generator=gen) * torch.rand(2, BLOCK, generator=gen) * 5  # heavy-tailed
    error = torch.zeros_like(x)
    total = torch.zeros_like(x)
    norms = []
    for k in range(1, 401):
        total += decompress(*compress_with_feedback(x, error))
        norms.append(float(error.norm()))
        assert torch.allclose(total / k, x - error / k, atol=1e-4)
    assert norms[-1] < 1.1 * norms[199]  # flat over the last 200 compressions
    assert (total / 400 - x).abs().max() < 0.1 * (decompress(*compress(x)) - x).abs().max()


def test_one_process_mean_is_the_twice_compressed_input_and_its_payload_is_a_thirtieth() -> None:
    numel = 3 * BLOCK + 17  # not a whole number of blocks: padded, the padding never returned
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    mean = CompressedMean(numel, torch.device("cpu"))
    out = mean(flat)
    assert out.shape == (numel,)
    padded = torch.zeros(4 * BLOCK)
    padded[:numel] = flat
    once = decompress(*compress(padded.view(4, BLOCK)))
    twice = decompress(*compress(once)).reshape(-1)[:numel]
    assert torch.allclose(out, twice)
    assert mean.bytes_per_phase == 4 * (BLOCK // 8 + 4)  # signs and one fp32 scale per block
    assert mean.bytes_per_phase / (4 * 4 * BLOCK) < 0.035  # of fp32 values (here a quarter block is padding)


def test_the_mean_of_a_steady_input_converges_to_it() -> None:
    numel = 2 * BLOCK
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    mean = CompressedMean(numel, torch.device("cpu"))
    total = torch.zeros(numel)
    for _ in range(400):
        total += mean(flat)
    one_shot = CompressedMean(numel, torch.device("cpu"))(flat)
    assert (total / 400 - flat).abs().max() < 0.1 * (one_shot - flat).abs().max()


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def train(optimizer_of, steps: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tiny_model(seed)
    optimizer = optimizer_of(model)
    data = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(32, 12, generator=data)
        loss = (model(x) - x[:, :3]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, optimizer


HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def test_until_its_freeze_it_is_adamw() -> None:
    adamw, _ = train(lambda m: torch.optim.AdamW(m.parameters(), **HYPER), 12)
    onebit, opt = train(lambda m: OneBitAdam(m.parameters(), OneBitComm(freeze_steps=12), **HYPER), 12)
    for a, b in zip(adamw.parameters(), onebit.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    assert set(opt.state[next(onebit.parameters())]) == {"step", "exp_avg", "exp_avg_sq"}  # AdamW's names


def test_after_its_freeze_the_variance_stays_and_training_goes_on() -> None:
    comm = OneBitComm(freeze_steps=10)
    model, opt = train(lambda m: OneBitAdam(m.parameters(), comm, **HYPER), 10)
    variance = {id(p): opt.state[p]["exp_avg_sq"].clone() for p in model.parameters()}
    assert comm.steps_done == 10 and comm.compressing and comm.mean is None
    data = torch.Generator().manual_seed(9)
    losses = []
    for _ in range(60):
        x = torch.randn(32, 12, generator=data)
        loss = (model(x) - x[:, :3]).pow(2).mean()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    for p in model.parameters():
        assert torch.equal(opt.state[p]["exp_avg_sq"], variance[id(p)])
        assert int(opt.state[p]["step"]) == 70
    assert comm.mean is not None and comm.mean.worker_error.abs().sum() > 0
    assert sum(losses[-10:]) < 0.7 * sum(losses[:10])


def test_a_loaded_state_tells_the_hook_which_phase_it_is_in() -> None:
    _, trained = train(lambda m: OneBitAdam(m.parameters(), OneBitComm(freeze_steps=5), **HYPER), 7)
    fresh_comm = OneBitComm(freeze_steps=5)
    fresh = OneBitAdam(tiny_model(1).parameters(), fresh_comm, **HYPER)
    assert not fresh_comm.compressing
    fresh.load_state_dict(trained.state_dict())
    assert fresh_comm.steps_done == 7 and fresh_comm.compressing


def test_error_feedback_from_another_world_size_is_dropped() -> None:
    comm = OneBitComm(freeze_steps=1)
    comm.average(torch.randn(BLOCK))
    saved = comm.state_dict(world_size=2)
    assert saved["numel"] == BLOCK and saved["worker_error"].abs().sum() > 0
    other = OneBitComm(freeze_steps=1)
    assert other.load_state_dict(saved, world_size=4) == ["error feedback (saved by 2 ranks, now 4)"]
    same = OneBitComm(freeze_steps=1)
    assert same.load_state_dict(saved, world_size=2) == []
    # The first compressed step places the saved errors: a zero momentum then sends what the last step lacked.
    assert same.average(torch.zeros(BLOCK)).abs().sum() > 0
    assert OneBitComm(freeze_steps=1).average(torch.zeros(BLOCK)).abs().sum() == 0


def test_values_that_had_no_gradient_before_the_freeze_do_not_move_after_it() -> None:
    # An embedding whose last rows (tokens 6..9) never occur in the warm-up: their variance freezes at 0, and the
    # compressed momentum (a block's scale on every value) would move them by lr x scale / eps per step.
    torch.manual_seed(0)
    embedding, head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10)
    params = [*embedding.parameters(), *head.parameters()]
    comm = OneBitComm(freeze_steps=5)
    opt = OneBitAdam(params, comm, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)  # no weight decay: unseen rows stay put
    gen = torch.Generator().manual_seed(3)

    def step(high: int) -> None:
        tokens = torch.randint(0, high, (16,), generator=gen)
        loss = torch.nn.functional.cross_entropy(head(embedding(tokens)), tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(5):
        step(6)  # tokens 0..5 only
    unseen = embedding.weight[6:].detach().clone()
    assert torch.all(opt.state[embedding.weight]["exp_avg_sq"][6:] == 0)
    for _ in range(20):
        step(6)
    assert torch.equal(embedding.weight[6:], unseen)
    assert torch.all(opt.state[embedding.weight]["exp_avg"][6:] == 0)
    assert embedding.weight[:6].abs().max() < 100  # the seen rows train, within reason
