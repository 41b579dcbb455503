"""The LightningDataModule behind every built-in data option.

Lightning is told not to insert its own DistributedSampler (``use_distributed_sampler=False``): this module
hands it one with the same per-epoch semantics but a world-size-invariant global order that restarts at the
restored optimizer step (see ``sampling.py``), which makes DDP/FSDP runs match a single process and makes
resume exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
import numpy as np
from torch.utils.data import DataLoader, Dataset

from disttrain.config.schema import HFDataConfig, SyntheticDataConfig, TextDataConfig, TokensDataConfig
from disttrain.data.hf import prepare_corpus
from disttrain.data.markov import MarkovSource
from disttrain.data.sampling import ResumableShardedSampler, ShardedEvalSampler
from disttrain.data.sources import WindowDataset, check_token_range, open_token_file, read_text_bytes, split_stream

# Synthetic chains are cut into rows of this many windows; every window of a stationary chain is stationary.
WINDOWS_PER_CHAIN = 32


@dataclass(frozen=True)
class LossFloor:
    """What the best possible model would score on this data (nats per target token)."""

    entropy_rate: float
    window_floor: float  # includes the short-context start of each window


class TokenDataModule(pl.LightningDataModule):
    """Windows of ``seq_len + 1`` tokens from a synthetic, text or token-file source."""

    def __init__(
        self,
        cfg: SyntheticDataConfig | TextDataConfig | TokensDataConfig | HFDataConfig,
        seq_len: int,
        micro_batch_size: int,
        global_batch_size: int,
        seed: int,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.loss_floor: LossFloor | None = None
        self._restored: tuple[int, int] | None = None  # (samples consumed, at global step) from a checkpoint

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        cfg = self.cfg
        if isinstance(cfg, SyntheticDataConfig):
            source = MarkovSource(cfg.vocab_size, cfg.order, cfg.concentration, cfg.source_seed)
            self.train_set = WindowDataset(self._chains(source, cfg.num_train_tokens, cfg.source_seed), self.seq_len)
            self.val_set = WindowDataset(self._chains(source, cfg.num_val_tokens, cfg.source_seed + 1), self.seq_len)
            self.loss_floor = LossFloor(source.entropy_rate(), source.window_floor(self.seq_len))
        elif isinstance(cfg, HFDataConfig):
            corpus = prepare_corpus(cfg)  # validation tokenized it before launch: here it is a cache hit
            if corpus.val is None:
                train, val = split_stream(corpus.open("train"), cfg.val_fraction, self.seq_len)
            else:
                train, val = corpus.open("train"), corpus.open("val")
            self.train_set, self.val_set = WindowDataset(train, self.seq_len), WindowDataset(val, self.seq_len)
        elif isinstance(cfg, TextDataConfig):
            train, val = split_stream(read_text_bytes(cfg.path), cfg.val_fraction, self.seq_len)
            self.train_set, self.val_set = WindowDataset(train, self.seq_len), WindowDataset(val, self.seq_len)
        else:
            tokens = open_token_file(cfg.train_path, "data.train_path")
            check_token_range(tokens, cfg.vocab_size, "data.train_path")
            if cfg.val_path is None:
                train, val = split_stream(tokens, cfg.val_fraction, self.seq_len)
            else:
                train, val = tokens, open_token_file(cfg.val_path, "data.val_path")
                check_token_range(val, cfg.vocab_size, "data.val_path")
            self.train_set, self.val_set = WindowDataset(train, self.seq_len), WindowDataset(val, self.seq_len)

    def _chains(self, source: MarkovSource, num_tokens: int, seed: int) -> np.ndarray:
        row_tokens = WINDOWS_PER_CHAIN * self.seq_len
        rows = max(1, -(-num_tokens // row_tokens))
        return source.sample(rows, row_tokens + 1, seed)

    def _replicas(self) -> tuple[int, int]:
        if self.trainer is None:
            return 1, 0
        # Single-device strategies have no sampler kwargs: one replica.
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    def samples_consumed(self) -> int:
        """Global samples used by the optimizer steps already taken (restored from a checkpoint on resume)."""
        step = 0 if self.trainer is None else self.trainer.global_step
        if self._restored is None:
            return step * self.global_batch_size
        # Continue from the recorded stream position, so a resume with a different global batch size neither
        # repeats nor skips samples.
        samples, at_step = self._restored
        return samples + (step - at_step) * self.global_batch_size

    def state_dict(self) -> dict[str, int]:
        """The data position, saved in every checkpoint (Lightning stores it under this class's name)."""
        step = 0 if self.trainer is None else self.trainer.global_step
        return {"samples_consumed": self.samples_consumed(), "global_step": step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._restored = (int(state["samples_consumed"]), int(state["global_step"]))

    def _loader(self, dataset: Dataset, sampler) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.micro_batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.cfg.num_workers,
            pin_memory=self.cfg.pin_memory,
            persistent_workers=self.cfg.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "setup() must run first"
        num_replicas, rank = self._replicas()
        # The sampler shards the stream in rounds of one sample per rank: a position recorded under another
        # world size is rounded up to the next round (at most num_replicas - 1 samples are not seen).
        start = -(-self.samples_consumed() // num_replicas) * num_replicas
        sampler = ResumableShardedSampler(len(self.train_set), num_replicas, rank, self.seed, start)
        return self._loader(self.train_set, sampler)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None, "setup() must run first"
        num_replicas, rank = self._replicas()
        return self._loader(self.val_set, ShardedEvalSampler(len(self.val_set), num_replicas, rank))
