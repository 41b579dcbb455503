"""The Markov source's exact entropies against samples and hand formulas, and the file readers' errors."""

from __future__ import annotations

import itertools
import math
import pickle

import numpy as np
import pytest
import torch

from disttrain.config.errors import ConfigError
from disttrain.data.markov import MarkovSource
from disttrain.data.sources import (
    WindowDataset,
    check_token_range,
    open_token_file,
    read_text_bytes,
    split_stream,
)


def binary_entropy(p: float) -> float:
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


@pytest.fixture(scope="module")
def default_source() -> MarkovSource:
    """The synthetic data config's default source."""
    return MarkovSource(vocab_size=64, order=2, concentration=0.05, seed=1234)


# --- entropy: closed form against samples --------------------------------------------------------------------


def test_entropy_rate_matches_mean_negative_log_prob(default_source: MarkovSource) -> None:
    tokens = default_source.sample(num_chains=2048, length=600, seed=7)  # 1.2M tokens
    nll = -default_source.log_prob(tokens)
    assert nll.shape == (2048, 598)
    # Chains are independent and each starts stationary, so chain means are iid with mean exactly the rate;
    # their spread gives an honest standard error despite correlations along a chain.
    chain_means = nll.mean(axis=1)
    se = chain_means.std(ddof=1) / math.sqrt(len(chain_means))
    assert abs(chain_means.mean() - default_source.entropy_rate()) < 4 * se
    assert se < 0.005


def test_plug_in_entropy_from_counts_on_small_source() -> None:
    source = MarkovSource(vocab_size=4, order=1, concentration=1.0, seed=3)
    tokens = source.sample(num_chains=1000, length=1000, seed=11)
    pairs = tokens[:, :-1].astype(np.int64) * 4 + tokens[:, 1:]
    counts = np.bincount(pairs.ravel(), minlength=16).reshape(4, 4).astype(np.float64)
    cond = counts / counts.sum(axis=1, keepdims=True)
    plug_in = -(counts / counts.sum() * np.log(cond)).sum()
    assert plug_in == pytest.approx(source.entropy_rate(), abs=3e-3)
    assert np.allclose(counts.sum(axis=1) / counts.sum(), source.stationary_distribution(), atol=3e-3)


def test_two_state_chain_by_hand() -> None:
    a, b = 0.1, 0.3  # P(0 -> 1), P(1 -> 0)
    source = MarkovSource.from_transitions(np.array([[1 - a, a], [b, 1 - b]]))
    assert source.order == 1 and source.vocab_size == 2
    pi0, pi1 = b / (a + b), a / (a + b)  # 0.75, 0.25
    assert np.allclose(source.stationary_distribution(), [pi0, pi1], rtol=0, atol=1e-14)
    expected = pi0 * binary_entropy(a) + pi1 * binary_entropy(b)
    assert source.entropy_rate() == pytest.approx(expected, rel=1e-13)
    # Order 1: every target sees its whole context, so the window floor is the rate for every T.
    for seq_len in (1, 2, 7, 128):
        assert source.window_floor(seq_len) == pytest.approx(expected, rel=1e-12)
    log_p = source.log_prob(np.array([[0, 0, 1, 1, 0]]))
    assert np.allclose(log_p, np.log([[1 - a, a, 1 - b, b]]))


def test_nearly_decoupled_chain_is_solved_exactly() -> None:
    # Escape probabilities of 1e-12 mix in ~1e12 steps: a power-iteration step changes pi by ~1e-15 and would
    # look converged at the uniform start, though pi0 = b / (a + b) = 0.5005.
    a, b = 1e-12, 1.002e-12
    source = MarkovSource.from_transitions(np.array([[1 - a, a], [b, 1 - b]]))
    assert source.stationary_distribution()[0] == pytest.approx(b / (a + b), rel=1e-9)


def test_stationary_distribution_is_invariant(default_source: MarkovSource) -> None:
    pi = default_source.stationary_distribution()
    assert pi.shape == (64**2,)
    assert pi.sum() == pytest.approx(1.0, abs=1e-14)
    # The 2-gram marginal of the stationary 3-gram (drop the oldest token) is pi again.
    assert np.abs(default_source.ngram_distribution(2) - pi).sum() < 1e-13


def test_window_floor_order_two_by_enumeration() -> None:
    source = MarkovSource(vocab_size=3, order=2, concentration=0.5, seed=5)
    pi, probs = source.stationary_distribution(), source.transitions
    pair = {(x0, x1): pi[x0 * 3 + x1] for x0, x1 in itertools.product(range(3), repeat=2)}
    first = {x0: sum(pair[x0, x1] for x1 in range(3)) for x0 in range(3)}
    h_one_back = -sum(p * math.log(p / first[x0]) for (x0, _), p in pair.items())
    triple = {
        (x0, x1, x2): pair[x0, x1] * probs[x0 * 3 + x1, x2] for x0, x1, x2 in itertools.product(range(3), repeat=3)
    }
    rate = -sum(p * math.log(p / pair[x0, x1]) for (x0, x1, _), p in triple.items())
    # Stationarity: the pair (x1, x2) has the same law as (x0, x1).
    for x1, x2 in itertools.product(range(3), repeat=2):
        assert sum(triple[x0, x1, x2] for x0 in range(3)) == pytest.approx(pair[x1, x2], abs=1e-14)

    assert source.entropy_rate() == pytest.approx(rate, rel=1e-12)
    assert source.conditional_entropy(1) == pytest.approx(h_one_back, rel=1e-12)
    assert source.window_floor(1) == pytest.approx(h_one_back, rel=1e-12)
    assert source.window_floor(2) == pytest.approx((h_one_back + rate) / 2, rel=1e-12)
    assert source.window_floor(10) == pytest.approx((h_one_back + 9 * rate) / 10, rel=1e-12)


def test_window_floor_is_above_the_rate_and_decreases_to_it(default_source: MarkovSource) -> None:
    source = MarkovSource(vocab_size=8, order=3, concentration=0.1, seed=2)
    for src in (source, default_source):
        rate = src.entropy_rate()
        floors = [src.window_floor(t) for t in (1, 2, 3, 4, 8, 32, 128, 1024, 1_000_000)]
        assert all(f >= rate - 1e-12 for f in floors)
        assert all(later < earlier for earlier, later in itertools.pairwise(floors))
        assert floors[-1] - rate < 1e-4
    assert default_source.window_floor(128) - default_source.entropy_rate() > 0.01  # 1 of 128 targets sees 1 token


def test_sampled_window_loss_matches_window_floor() -> None:
    source = MarkovSource(vocab_size=8, order=3, concentration=0.1, seed=2)
    seq_len = 8
    windows = source.sample(num_chains=100_000, length=seq_len + 1, seed=4)
    nll = -source.window_log_prob(windows)
    assert nll.shape == (100_000, seq_len)
    per_window = nll.mean(axis=1)
    se = per_window.std(ddof=1) / math.sqrt(len(per_window))
    floor = source.window_floor(seq_len)
    assert abs(per_window.mean() - floor) < 4 * se
    assert floor - source.entropy_rate() > 20 * se  # the truncated-context correction is really being tested


def test_concentration_sets_predictability() -> None:
    flat = MarkovSource(vocab_size=16, order=1, concentration=1e4, seed=0)
    peaked = MarkovSource(vocab_size=16, order=1, concentration=0.01, seed=0)
    assert flat.entropy_rate() == pytest.approx(math.log(16), abs=2e-3)
    assert peaked.entropy_rate() < 0.3 * math.log(16)
    assert np.isfinite(peaked.log_prob(np.arange(16).reshape(1, 16))).all()  # floored: no -inf from exact zeros


# --- sampling --------------------------------------------------------------------------------------------------


def test_sampling_is_deterministic_per_seed() -> None:
    source = MarkovSource(vocab_size=10, order=2, concentration=0.3, seed=9)
    first = source.sample(num_chains=50, length=40, seed=1)
    assert first.dtype == np.uint8 and first.shape == (50, 40)
    assert np.array_equal(first, source.sample(num_chains=50, length=40, seed=1))
    assert not np.array_equal(first, source.sample(num_chains=50, length=40, seed=2))
    # The source itself is fixed by its own seed.
    assert np.array_equal(source.transitions, MarkovSource(10, 2, 0.3, seed=9).transitions)
    assert not np.array_equal(source.transitions, MarkovSource(10, 2, 0.3, seed=10).transitions)


def test_wide_vocab_samples_uint16() -> None:
    tokens = MarkovSource(vocab_size=300, order=1, concentration=0.5, seed=0).sample(num_chains=4, length=8, seed=0)
    assert tokens.dtype == np.uint16 and int(tokens.max()) < 300


def test_first_tokens_follow_the_stationary_distribution() -> None:
    source = MarkovSource(vocab_size=4, order=2, concentration=0.5, seed=1)
    starts = source.sample(num_chains=200_000, length=2, seed=3).astype(np.int64)
    empirical = np.bincount(starts[:, 0] * 4 + starts[:, 1], minlength=16) / len(starts)
    assert np.abs(empirical - source.stationary_distribution()).max() < 5e-3


def test_short_samples_and_empty_log_prob() -> None:
    source = MarkovSource(vocab_size=5, order=3, concentration=1.0, seed=0)
    assert source.sample(num_chains=3, length=2, seed=0).shape == (3, 2)
    assert source.log_prob(np.zeros((3, 3), dtype=np.int64)).shape == (3, 0)
    with pytest.raises(ValueError, match="tokens must be integers"):
        source.log_prob(np.array([[0, 1, 2, 5]]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 1, "order": 1, "concentration": 1.0}, "vocab_size must be >= 2"),
        ({"vocab_size": 4, "order": 0, "concentration": 1.0}, "order must be >= 1"),
        ({"vocab_size": 4, "order": 1, "concentration": 0.0}, "concentration"),
        ({"vocab_size": 4, "order": 1, "concentration": float("nan")}, "concentration"),
        ({"vocab_size": 8192, "order": 2, "concentration": 1.0}, "lower the vocab size or the order"),
    ],
)
def test_invalid_source_is_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MarkovSource(seed=0, **kwargs)


def test_invalid_transition_tables_are_rejected() -> None:
    with pytest.raises(ValueError, match="not V\\*\\*k"):
        MarkovSource.from_transitions(np.full((3, 2), 0.5))
    with pytest.raises(ValueError, match="sum to 1"):
        MarkovSource.from_transitions(np.array([[0.5, 0.6], [0.5, 0.5]]))
    with pytest.raises(ValueError, match="non-negative"):
        MarkovSource.from_transitions(np.array([[1.5, -0.5], [0.5, 0.5]]))


# --- windows ---------------------------------------------------------------------------------------------------


def test_window_dataset_contents_and_length() -> None:
    data = np.arange(30, dtype=np.int64).reshape(3, 10)  # each row: 9 targets -> 2 windows of 4, one token spare
    ds = WindowDataset(data, seq_len=4)
    assert len(ds) == 6
    x, y = ds[0]
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    assert x.tolist() == [0, 1, 2, 3] and y.tolist() == [1, 2, 3, 4]
    assert [t.tolist() for t in ds[1]] == [[4, 5, 6, 7], [5, 6, 7, 8]]
    assert [t.tolist() for t in ds[2]] == [[10, 11, 12, 13], [11, 12, 13, 14]]  # row 1, never rows 0 and 1 mixed
    assert [t.tolist() for t in ds[-1]] == [[24, 25, 26, 27], [25, 26, 27, 28]]
    for i in range(len(ds)):
        x, y = ds[i]
        assert int(x[0]) // 10 == int(y[-1]) // 10  # a window stays in its row
    with pytest.raises(IndexError):
        ds[6]


def test_window_dataset_targets_each_token_once() -> None:
    ds = WindowDataset(np.arange(17, dtype=np.uint16), seq_len=4)  # 1-D stream = one row, 16 targets exactly
    assert len(ds) == 4
    targets = torch.cat([ds[i][1] for i in range(len(ds))])
    assert targets.tolist() == list(range(1, 17))


def test_window_dataset_rejects_rows_too_short() -> None:
    with pytest.raises(ValueError, match="no window"):
        WindowDataset(np.arange(4, dtype=np.int64), seq_len=4)
    with pytest.raises(TypeError):
        WindowDataset(np.zeros(10, dtype=np.float32), seq_len=2)


def test_window_dataset_on_memmap_reopens_when_pickled(tmp_path) -> None:
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    stream = open_token_file(str(path), "data.train_path")
    _, val = split_stream(stream, val_fraction=0.1, seq_len=8)
    assert isinstance(val, np.memmap)
    ds = WindowDataset(val, seq_len=8)
    assert len(ds) == (100 - 1) // 8
    assert ds[0][0].tolist() == list(range(900, 908))
    clone = pickle.loads(pickle.dumps(ds))
    assert isinstance(clone.data, np.memmap)
    assert len(pickle.dumps(ds)) < 1000  # the file's path travels, not its tokens
    assert all(torch.equal(a, b) for i in range(len(ds)) for a, b in zip(ds[i], clone[i], strict=True))


# --- file readers and their errors -----------------------------------------------------------------------------


def test_read_text_bytes(tmp_path) -> None:
    path = tmp_path / "tiny.txt"
    path.write_bytes("héllo\n".encode())
    data = read_text_bytes(str(path))
    assert data.dtype == np.uint8 and bytes(data) == "héllo\n".encode()


@pytest.mark.parametrize("case", ["missing", "directory", "empty", "unreadable"])
def test_read_text_bytes_errors(tmp_path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    path = tmp_path / "corpus.txt"
    if case == "directory":
        path.mkdir()
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "unreadable":
        path.write_bytes(b"text")

        def denied(*args: object, **kwargs: object) -> None:
            raise PermissionError(13, "Permission denied")

        # chmod 0 does not stop root, which runs this suite in the container; fail the read itself instead.
        monkeypatch.setattr(np, "fromfile", denied)
    with pytest.raises(ConfigError) as info:
        read_text_bytes(str(path))
    assert info.value.key == "data.path"
    assert "existing non-empty text file" in str(info.value)


def test_open_token_file(tmp_path) -> None:
    path = tmp_path / "train.bin"
    np.array([3, 1, 65535], dtype=np.uint16).tofile(path)
    tokens = open_token_file(str(path), "data.train_path")
    assert tokens.dtype == np.uint16 and tokens.tolist() == [3, 1, 65535]
    assert not tokens.flags.writeable


@pytest.mark.parametrize(("case", "problem"), [("missing", "does not exist"), ("empty", "empty"), ("odd", "odd")])
def test_open_token_file_errors(tmp_path, case: str, problem: str) -> None:
    path = tmp_path / "val.bin"
    if case == "empty":
        path.write_bytes(b"")
    elif case == "odd":
        path.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ConfigError) as info:
        open_token_file(str(path), "data.val_path")
    assert info.value.key == "data.val_path"
    assert problem in info.value.problem
    assert "uint16" in info.value.fix


def test_check_token_range() -> None:
    check_token_range(np.array([0, 5, 99], dtype=np.uint16), vocab_size=100, key="data.vocab_size")
    with pytest.raises(ConfigError) as info:
        check_token_range(np.array([0, 5, 100, 7], dtype=np.uint16), vocab_size=100, key="data.vocab_size")
    assert info.value.key == "data.vocab_size"
    assert "at least 101" in info.value.fix


def test_check_token_range_scans_only_the_head() -> None:
    tokens = np.zeros(5_000_000, dtype=np.uint16)
    tokens[-1] = 60000  # beyond the first 4M tokens: not scanned, so a huge file costs a bounded read
    check_token_range(tokens, vocab_size=10, key="data.vocab_size")


def test_split_stream() -> None:
    stream = np.arange(1000, dtype=np.uint16)
    train, val = split_stream(stream, val_fraction=0.05, seq_len=16)
    assert len(train) == 950 and len(val) == 50
    assert np.array_equal(np.concatenate([train, val]), stream)


def test_split_stream_too_short_says_how_many_tokens() -> None:
    with pytest.raises(ConfigError) as info:
        split_stream(np.arange(1000, dtype=np.uint16), val_fraction=0.05, seq_len=128)
    assert info.value.key == "data.val_fraction"
    assert "at least 2580 tokens" in info.value.fix  # 129 val tokens at 5%
    assert "between 0.129 and 0.871" in info.value.fix
    _, val = split_stream(np.arange(2580, dtype=np.uint16), val_fraction=0.05, seq_len=128)
    assert len(val) == 129
    with pytest.raises(ConfigError) as info:
        split_stream(np.arange(100, dtype=np.uint16), val_fraction=0.5, seq_len=128)
    assert "at least 258 tokens" in info.value.fix and "between" not in info.value.fix
    with pytest.raises(ConfigError, match="strictly between 0 and 1"):
        split_stream(np.arange(100, dtype=np.uint16), val_fraction=0.0, seq_len=4)
