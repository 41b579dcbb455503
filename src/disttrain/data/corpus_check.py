"""A ``data=hf`` run's corpus, tokenized into its cache before launch (a named step of ``prepare``: ranks then only
map it) and checked against the model: the tokenizer's ids fit its vocabulary, the splits hold a sequence."""

from __future__ import annotations

from disttrain.config.errors import ConfigError
from disttrain.config.schema import HFDataConfig, HFModelConfig, LightningModuleConfig, RunConfig
from disttrain.data.hf import prepare_corpus


def tokenize_corpus(cfg: RunConfig) -> None:
    """Tokenize a ``data=hf`` corpus into its cache (once per corpus and tokenizer) and check it fits the model;
    nothing for other data."""
    d = cfg.data
    if not isinstance(d, HFDataConfig) or isinstance(cfg.model, LightningModuleConfig):  # validation refuses those
        return
    from disttrain.data.sources import split_stream  # imports torch: only for an HF corpus

    corpus = prepare_corpus(d)
    model_vocab = cfg.model.vocab_size
    if corpus.vocab_size > model_vocab:
        key = "model.config.vocab_size" if isinstance(cfg.model, HFModelConfig) else "model.vocab_size"
        raise ConfigError(
            "data.tokenizer",
            f"the tokenizer has {corpus.vocab_size} ids, more than the model's vocabulary ({model_vocab})",
            f"set {key}>={corpus.vocab_size}, or use a tokenizer with at most {model_vocab} ids",
        )
    train = corpus.open("train")
    if corpus.val is None:
        split_stream(train, d.val_fraction, cfg.model.seq_len)
    elif corpus.open("val").shape[0] < cfg.model.seq_len + 1:
        raise ConfigError("data.val_files", f"hold fewer than seq_len + 1 = {cfg.model.seq_len + 1} tokens", "add text")
