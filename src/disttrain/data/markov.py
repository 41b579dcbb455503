"""A seeded random order-k Markov source whose loss floor is known exactly.

Each of the ``V**k`` contexts (the last k tokens, read as a base-V number with the oldest token first) gets a
next-token distribution drawn from a symmetric Dirichlet. Because the process is known, so is the best loss any
model can reach: ``entropy_rate()`` for an unbounded context and ``window_floor(seq_len)`` for a training window,
where the first targets see fewer than k earlier tokens.
"""

from __future__ import annotations

import math

import numpy as np

from disttrain.config.schema import MAX_TABLE_ENTRIES

PROB_FLOOR = 1e-12  # Dirichlet draws at low concentration underflow to exact 0; a floor keeps log-probs finite
STATIONARY_TOL = 1e-14  # L1 change between power iterations at which pi may count as converged
STATIONARY_ERROR_TOL = 1e-12  # ... if the estimated L1 distance still to go is below this too
MAX_POWER_ITERATIONS = 5000
GTH_MAX_CONTEXTS = 512  # up to here pi comes from the subtraction-free GTH elimination (exact, ~0.05 s)
DENSE_SOLVE_MAX_CONTEXTS = 4096  # fallback linear solve on a C x C matrix: 128 MiB and a few seconds at most


class MarkovSource:
    """Order-k Markov chain over ``vocab_size`` tokens with Dirichlet(``concentration``) transition rows."""

    def __init__(self, vocab_size: int, order: int, concentration: float, seed: int) -> None:
        _check_table_shape(vocab_size, order)
        if not (math.isfinite(concentration) and concentration > 0):
            raise ValueError(f"MarkovSource concentration must be a finite number > 0, got {concentration}")
        rng = np.random.default_rng(seed)
        probs = rng.dirichlet(np.full(vocab_size, float(concentration)), size=vocab_size**order)
        probs = np.maximum(np.nan_to_num(probs, nan=0.0), PROB_FLOOR)
        probs /= probs.sum(axis=1, keepdims=True)
        self._setup(probs, order, float(concentration), seed)

    @classmethod
    def from_transitions(cls, transitions: np.ndarray) -> MarkovSource:
        """A source with the given ``[V**k, V]`` next-token table (row = context, oldest token most significant).

        The order k is read from the number of rows. No floor is applied: zero entries stay zero, so the chain
        must be irreducible for the stationary distribution to be unique.
        """
        probs = np.array(transitions, dtype=np.float64)
        if probs.ndim != 2 or probs.shape[1] < 2:
            raise ValueError(f"transitions must be a [V**k, V] table with V >= 2, got shape {probs.shape}")
        vocab_size, num_rows = probs.shape[1], probs.shape[0]
        order = round(math.log(num_rows, vocab_size)) if num_rows > 1 else 0
        if order < 1 or vocab_size**order != num_rows:
            raise ValueError(f"transitions has {num_rows} rows, which is not V**k for V={vocab_size} and any k >= 1")
        _check_table_shape(vocab_size, order)
        if not np.all(np.isfinite(probs)) or np.any(probs < 0):
            raise ValueError("transitions must be finite and non-negative")
        sums = probs.sum(axis=1)
        if np.any(np.abs(sums - 1.0) > 1e-9):
            raise ValueError(f"every row of transitions must sum to 1; row {int(np.argmax(np.abs(sums - 1)))} does not")
        source = cls.__new__(cls)
        source._setup(probs / sums[:, None], order, None, None)
        return source

    def _setup(self, probs: np.ndarray, order: int, concentration: float | None, seed: int | None) -> None:
        self.vocab_size = probs.shape[1]
        self.order = order
        self.concentration = concentration
        self.seed = seed
        self.num_contexts = probs.shape[0]
        self._probs = probs
        self._probs.setflags(write=False)
        self._stationary: np.ndarray | None = None
        self._cumulative: np.ndarray | None = None
        self._ngram_entropies: list[float] | None = None

    @property
    def transitions(self) -> np.ndarray:
        """The read-only ``[V**k, V]`` next-token table."""
        return self._probs

    def stationary_distribution(self) -> np.ndarray:
        """Stationary probability of each of the ``V**k`` contexts (cached)."""
        if self._stationary is None:
            if self.num_contexts <= GTH_MAX_CONTEXTS:
                pi = _gth_stationary(self._context_matrix())
            else:
                pi = self._power_iteration()
                if pi is None:
                    pi = self._dense_solve()
            pi.setflags(write=False)
            self._stationary = pi
        return self._stationary

    def _context_matrix(self) -> np.ndarray:
        """Dense context-to-context transition matrix: c moves to (c mod V**(k-1)) * V + x with P(x|c)."""
        num, vocab = self.num_contexts, self.vocab_size
        contexts = np.arange(num)
        successors = (contexts % (num // vocab))[:, None] * vocab + np.arange(vocab)[None, :]
        matrix = np.zeros((num, num))
        matrix[np.repeat(contexts, vocab), successors.ravel()] = self._probs.ravel()  # (c, x) -> c' is one-to-one
        return matrix

    def _step(self, pi: np.ndarray) -> np.ndarray:
        # pi(c) P(x|c) is the stationary (k+1)-gram; summing out its oldest token gives the next context's mass.
        joint = pi[:, None] * self._probs
        return joint.reshape(self.vocab_size, self.num_contexts).sum(axis=0)

    def _power_iteration(self) -> np.ndarray | None:
        pi = np.full(self.num_contexts, 1.0 / self.num_contexts)
        previous = math.inf
        for _ in range(MAX_POWER_ITERATIONS):
            new = self._step(pi)
            new /= new.sum()
            change = float(np.abs(new - pi).sum())
            pi = new
            # A small step alone is not convergence: a nearly-decomposable chain creeps. The geometric tail
            # change * r / (1 - r), with r the observed contraction, bounds the distance still to go.
            ratio = change / previous
            if change < STATIONARY_TOL and ratio < 1 and change * ratio / (1 - ratio) < STATIONARY_ERROR_TOL:
                return pi
            previous = change
        return None

    def _dense_solve(self) -> np.ndarray:
        if self.num_contexts > DENSE_SOLVE_MAX_CONTEXTS:
            raise RuntimeError(
                f"the stationary distribution of this order-{self.order} source over {self.num_contexts} contexts did "
                f"not converge in {MAX_POWER_ITERATIONS} power iterations (the chain mixes too slowly); raise the "
                "concentration or lower the order"
            )
        # Solve pi (Q - I) = 0. The diagonal is minus the off-diagonal outflow rather than Q[c, c] - 1, which
        # would cancel away the tiny escape probabilities that make the chain slow in the first place.
        generator = self._context_matrix().T
        np.fill_diagonal(generator, 0.0)
        np.fill_diagonal(generator, -generator.sum(axis=0))
        generator[-1, :] = 1.0  # one balance equation is redundant; the normalisation replaces it
        rhs = np.zeros(self.num_contexts)
        rhs[-1] = 1.0
        pi = np.clip(np.linalg.solve(generator, rhs), 0.0, None)
        return pi / pi.sum()

    def ngram_distribution(self, n: int) -> np.ndarray:
        """Stationary law of ``n`` consecutive tokens (base-V index, oldest first), for 1 <= n <= k + 1."""
        if not 1 <= n <= self.order + 1:
            raise ValueError(f"n must be between 1 and order + 1 = {self.order + 1}, got {n}")
        joint = (self.stationary_distribution()[:, None] * self._probs).reshape(-1)
        return joint.reshape(self.vocab_size ** (self.order + 1 - n), self.vocab_size**n).sum(axis=0)

    def entropy_rate(self) -> float:
        """Entropy rate in nats: sum_c pi(c) H(P(.|c)), the loss floor with the full k-token context."""
        return float(self.stationary_distribution() @ _entropy(self._probs, axis=1))

    def conditional_entropy(self, context_len: int) -> float:
        """H(X | previous ``context_len`` tokens) in nats under the stationary process (the rate for len >= k)."""
        if context_len < 0:
            raise ValueError(f"context_len must be >= 0, got {context_len}")
        if context_len >= self.order:
            return self.entropy_rate()
        if self._ngram_entropies is None:
            self._ngram_entropies = [0.0] + [
                float(_entropy(self.ngram_distribution(n), axis=0)) for n in range(1, self.order + 1)
            ]
        return self._ngram_entropies[context_len + 1] - self._ngram_entropies[context_len]

    def window_floor(self, seq_len: int) -> float:
        """Minimum mean cross-entropy per target (nats) over a window of ``seq_len + 1`` stationary tokens.

        Target t (1-based) can use only the min(t, k) tokens before it inside the window, so the first k-1
        targets pay H(X | t previous) and the rest pay the entropy rate.
        """
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        short = min(seq_len, self.order - 1)
        total = sum(self.conditional_entropy(t) for t in range(1, short + 1))
        total += (seq_len - short) * self.entropy_rate()
        return total / seq_len

    def sample(self, num_chains: int, length: int, seed: int) -> np.ndarray:
        """``[num_chains, length]`` tokens, each chain started from the stationary distribution.

        dtype is uint8 for vocab <= 256, else uint16. Vectorised over chains: use many chains for speed.
        """
        if num_chains < 0 or length < 0:
            raise ValueError(f"num_chains and length must be >= 0, got {num_chains} and {length}")
        vocab, order = self.vocab_size, self.order
        rng = np.random.default_rng(seed)
        out = np.empty((num_chains, length), dtype=np.uint8 if vocab <= 256 else np.uint16)
        cum_pi = np.minimum(np.cumsum(self.stationary_distribution()), 1.0)
        cum_pi[-1] = 1.0
        ctx = np.minimum(np.searchsorted(cum_pi, rng.random(num_chains), side="right"), self.num_contexts - 1)
        for i in range(min(order, length)):
            out[:, i] = (ctx // vocab ** (order - 1 - i)) % vocab
        table = self._cumulative_table()
        steps = max(1, math.ceil(math.log2(vocab)))
        keep = self.num_contexts // vocab  # contexts mod V**(k-1): drop the oldest token
        for t in range(order, length):
            u = rng.random(num_chains)
            base = ctx * vocab
            # Inverse-CDF by a vectorised binary search: the smallest x with cum(x | ctx) > u.
            lo = np.zeros(num_chains, dtype=np.int64)
            hi = np.full(num_chains, vocab - 1, dtype=np.int64)
            for _ in range(steps):
                mid = (lo + hi) >> 1
                right = table[base + mid] <= u
                lo = np.where(right, mid + 1, lo)
                hi = np.where(right, hi, mid)
            out[:, t] = lo
            ctx = (ctx % keep) * vocab + lo
        return out

    def _cumulative_table(self) -> np.ndarray:
        if self._cumulative is None:
            cum = np.minimum(np.cumsum(self._probs, axis=1), 1.0)
            cum[:, -1] = 1.0  # u < 1 always finds a token even when rounding left the row sum below 1
            self._cumulative = cum.reshape(-1)
        return self._cumulative

    def log_prob(self, tokens: np.ndarray) -> np.ndarray:
        """True log P(x_t | previous k tokens) for t >= k of a ``[chains, length]`` array: ``[chains, length - k]``."""
        toks = self._as_tokens(tokens)
        length, order = toks.shape[-1], self.order
        if length <= order:
            return np.zeros((*toks.shape[:-1], 0))
        ctx = np.zeros((*toks.shape[:-1], length - order), dtype=np.int64)
        for i in range(order):
            ctx = ctx * self.vocab_size + toks[..., i : length - order + i]
        with np.errstate(divide="ignore"):  # a zero entry set via from_transitions is honestly -inf
            return np.log(self._probs[ctx, toks[..., order:]])

    def window_log_prob(self, windows: np.ndarray) -> np.ndarray:
        """Log-prob of targets 1..T of ``[n, T+1]`` windows under the best predictor that sees only the window.

        Target t uses the min(t, k) tokens before it, so ``-mean`` estimates ``window_floor(T)``.
        """
        toks = self._as_tokens(windows)
        if toks.ndim != 2 or toks.shape[1] < 2:
            raise ValueError(f"windows must be [n, T+1] with T >= 1, got shape {toks.shape}")
        vocab, seq_len = self.vocab_size, toks.shape[1] - 1
        parts = []
        for t in range(1, min(seq_len, self.order - 1) + 1):
            cond = self.ngram_distribution(t + 1).reshape(vocab**t, vocab) / self.ngram_distribution(t)[:, None]
            ctx = np.zeros(toks.shape[0], dtype=np.int64)
            for i in range(t):
                ctx = ctx * vocab + toks[:, i]
            with np.errstate(divide="ignore"):
                parts.append(np.log(cond[ctx, toks[:, t]])[:, None])
        if seq_len >= self.order:
            parts.append(self.log_prob(toks))
        return np.concatenate(parts, axis=1)

    def _as_tokens(self, tokens: np.ndarray) -> np.ndarray:
        toks = np.asarray(tokens)
        if toks.size and (not np.issubdtype(toks.dtype, np.integer) or toks.min() < 0 or toks.max() >= self.vocab_size):
            raise ValueError(f"tokens must be integers in [0, {self.vocab_size})")
        return toks.astype(np.int64, copy=False)


def _check_table_shape(vocab_size: int, order: int) -> None:
    if vocab_size < 2:
        raise ValueError(f"MarkovSource vocab_size must be >= 2, got {vocab_size}")
    if order < 1:
        raise ValueError(f"MarkovSource order must be >= 1, got {order}")
    entries = vocab_size**order * vocab_size
    if entries > MAX_TABLE_ENTRIES:
        raise ValueError(
            f"MarkovSource with vocab_size={vocab_size} and order={order} needs a table of V**k * V = {entries} "
            f"probabilities, more than the limit of {MAX_TABLE_ENTRIES}; lower the vocab size or the order"
        )


def _entropy(probs: np.ndarray, axis: int) -> np.ndarray:
    """Shannon entropy in nats along ``axis``, with 0 log 0 = 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(probs > 0, probs * np.log(probs), 0.0)
    return -terms.sum(axis=axis)


def _gth_stationary(matrix: np.ndarray) -> np.ndarray:
    """Stationary distribution of an irreducible row-stochastic matrix by Grassmann-Taksar-Heyman elimination.

    It never subtracts, so it keeps full relative accuracy even when states are nearly decoupled (tiny escape
    probabilities), where power iteration creeps and a plain linear solve loses the small entries to cancellation.
    """
    work = matrix.copy()
    num = work.shape[0]
    for k in range(num - 1, 0, -1):
        outflow = work[k, :k].sum()
        if outflow <= 0:
            raise ValueError("the transition table is reducible: some context can never reach the others")
        work[:k, k] /= outflow
        work[:k, :k] += np.outer(work[:k, k], work[k, :k])
    pi = np.zeros(num)
    pi[0] = 1.0
    for k in range(1, num):
        pi[k] = pi[:k] @ work[:k, k]
    return pi / pi.sum()
