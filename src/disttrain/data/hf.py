"""``data=hf``: local files through ``datasets``, a local tokenizer, one EOS-joined token stream cached on disk.

The corpus is tokenized once, before any rank starts (validation calls ``prepare_corpus``), into
``cache_dir/<key>/{train,val}.bin``: flat token ids (uint16 when the vocabulary fits, else uint32) that every rank
memory-maps. The key hashes the data files (path, size, mtime), the tokenizer file(s) and the settings that change
the stream, so a later run with the same inputs reuses the cache and any change makes a new one. Files are written
under a temporary name and renamed, so a reader never sees half a cache.

Every mistake is a ``ConfigError`` naming the key: files that do not exist, an unknown format, a missing text
column, a tokenizer that cannot be read or has no EOS, an empty corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from disttrain.config.errors import ConfigError
from disttrain.config.schema import HFDataConfig

CACHE_VERSION = 1  # bump when the stream layout changes: old caches are then ignored
FORMATS = ("auto", "json", "parquet", "csv", "text", "disk")
EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
EOS_CANDIDATES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>")
ENCODE_BATCH = 1000  # documents per tokenizer call


@dataclass(frozen=True)
class Corpus:
    """The cached token streams of a run (``val`` is None when it is carved out of ``train``)."""

    train: Path
    val: Path | None
    dtype: str
    vocab_size: int
    eos_id: int

    def open(self, which: str = "train") -> np.memmap:
        path = self.train if which == "train" else self.val
        assert path is not None
        return np.memmap(path, dtype=self.dtype, mode="r")


class LocalTokenizer:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json file, or the fast backend of an AutoTokenizer directory."""

    def __init__(self, path: str, eos_token: str | None) -> None:
        full = Path(path).expanduser()
        if not full.exists():
            raise ConfigError(
                "data.tokenizer", f"'{path}' does not exist", "point it at a tokenizer.json or a tokenizer directory"
            )
        self.files = sorted(full.rglob("*")) if full.is_dir() else [full]
        self.backend, auto_eos = _load_backend(full)
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.eos_id = _eos_id(self.backend, eos_token or auto_eos)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def fingerprint(self) -> str:
        return files_digest(self.files)


def tokenizer_sha256(path: str) -> str:
    """A digest of the tokenizer's files (what run.json records so a resume can tell a changed tokenizer)."""
    full = Path(path).expanduser()
    return files_digest(sorted(full.rglob("*")) if full.is_dir() else [full])


def files_digest(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        if file.is_file():
            digest.update(file.name.encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def _load_backend(full: Path) -> tuple[Any, str | None]:
    try:
        if full.is_file():
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(full)), None
        from transformers import AutoTokenizer

        auto = AutoTokenizer.from_pretrained(str(full), local_files_only=True)
    except Exception as err:  # tokenizers/transformers raise many types for an unreadable file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            "data.tokenizer", f"cannot load a tokenizer from '{full}' ({first})", "use a tokenizer.json or its dir"
        ) from None
    backend = getattr(auto, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(
            "data.tokenizer",
            f"'{full}' holds a slow (Python) tokenizer only",
            "save a fast tokenizer (tokenizer.json) with tokenizer.save_pretrained",
        )
    return backend, auto.eos_token


def _eos_id(backend: Any, eos_token: str | None) -> int:
    names = (eos_token,) if eos_token is not None else EOS_CANDIDATES
    for name in names:
        token_id = backend.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    raise ConfigError(
        "data.eos_token",
        f"the tokenizer has no end-of-document token ({'/'.join(n for n in names if n)} not in its vocabulary)",
        "set data.eos_token to a token of the tokenizer that ends a document",
    )


def resolve_files(files: list[str], key: str) -> list[Path]:
    if not files:
        raise ConfigError(key, "is empty", f"set {key}=[/path/a.jsonl,...]")
    paths = [Path(f).expanduser() for f in files]
    for given, path in zip(files, paths, strict=True):
        if not path.exists():
            raise ConfigError(key, f"'{given}' does not exist", f"set {key} to existing local files or directories")
    return paths


def file_format(cfg: HFDataConfig, paths: list[Path], key: str) -> str:
    if cfg.format not in FORMATS:
        raise ConfigError("data.format", f"'{cfg.format}' is not one of {list(FORMATS)}", "use data.format=auto")
    if cfg.format != "auto":
        return cfg.format
    if len(paths) == 1 and paths[0].is_dir():
        return "disk"
    kinds = {EXTENSIONS.get(p.suffix.lower()) for p in paths}
    if None in kinds or len(kinds) != 1:
        suffixes = sorted({p.suffix or "(none)" for p in paths})
        raise ConfigError(
            "data.format",
            f"cannot tell the format of {key} from the extensions {suffixes}",
            f"use one of {sorted(EXTENSIONS)} for all files, or set data.format to one of {list(FORMATS[1:])}",
        )
    return kinds.pop()  # type: ignore[return-value]


def load_texts(cfg: HFDataConfig, paths: list[Path], key: str) -> Any:
    """The ``datasets.Dataset`` of the files, checked to have the text column."""
    import datasets

    datasets.disable_progress_bars()
    kind = file_format(cfg, paths, key)
    try:
        if kind == "disk":
            loaded = datasets.load_from_disk(str(paths[0]))
            if isinstance(loaded, datasets.DatasetDict):
                loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
        else:
            loaded = datasets.load_dataset(kind, data_files=[str(p) for p in paths], split="train")
    except Exception as err:  # datasets raises many types for a malformed file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        problem = f"datasets cannot read the files as {kind} ({first})"
        raise ConfigError(key, problem, "check the files, or set data.format") from None
    column = cfg.text_column
    if column not in loaded.column_names:
        raise ConfigError(
            "data.text_column",
            f"'{column}' is not a column of {key} (columns: {loaded.column_names})",
            f"set data.text_column to one of {loaded.column_names}",
        )
    dtype = getattr(loaded.features[column], "dtype", None)
    if dtype not in ("string", "large_string"):
        raise ConfigError(
            "data.text_column",
            f"'{column}' holds {dtype or type(loaded.features[column]).__name__} values, not text",
            f"set data.text_column to a text column of {loaded.column_names}",
        )
    return loaded


def stream_key(cfg: HFDataConfig, tokenizer: LocalTokenizer, files: list[str]) -> str:
    """What one cached stream depends on: its files (path, size, mtime), format, column, tokenizer and EOS."""
    stamps = []
    for path in sorted(f for given in files for f in _all_files(Path(given).expanduser())):
        stat = path.stat()
        stamps.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    settings = {
        "version": CACHE_VERSION,
        "files": stamps,
        "format": cfg.format,
        "column": cfg.text_column,
        "eos": tokenizer.eos_id,
        "tokenizer": tokenizer.fingerprint(),
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:24]


def _all_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def _write_stream(cfg: HFDataConfig, tokenizer: LocalTokenizer, files: list[str], key: str, out: Path, dtype) -> int:
    texts = load_texts(cfg, resolve_files(files, key), key)
    column = texts[cfg.text_column]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    written = 0
    with open(tmp, "wb") as handle:
        for start in range(0, len(texts), ENCODE_BATCH):
            batch = [t for t in column[start : start + ENCODE_BATCH] if isinstance(t, str) and t]
            ids = [token for doc in tokenizer.encode(batch) for token in (*doc, tokenizer.eos_id)]
            np.asarray(ids, dtype=dtype).tofile(handle)
            written += len(ids)
    if written == 0:
        tmp.unlink()
        raise ConfigError(key, f"the column '{cfg.text_column}' holds no text (empty corpus)", "use files with text")
    os.replace(tmp, out)
    return written


def prepare_corpus(cfg: HFDataConfig) -> Corpus:
    """Tokenize the corpus into the cache unless it is there already; returns the cached streams.

    Each split is its own cache entry, so adding validation files does not re-tokenize the training files.
    """
    resolve_files(cfg.train_files, "data.train_files")
    if cfg.val_files is not None:
        resolve_files(cfg.val_files, "data.val_files")
    tokenizer = LocalTokenizer(cfg.tokenizer, cfg.eos_token)
    dtype = "uint16" if tokenizer.vocab_size <= 65536 else "uint32"
    cache = Path(cfg.cache_dir).expanduser()
    streams: dict[str, Path | None] = {"train": None, "val": None}
    for split, files in (("train", cfg.train_files), ("val", cfg.val_files)):
        if files is None:
            continue
        path = cache / f"{stream_key(cfg, tokenizer, files)}.{dtype}.bin"
        if not path.exists():
            _write_stream(cfg, tokenizer, files, f"data.{split}_files", path, dtype)
        streams[split] = path
    assert streams["train"] is not None
    return Corpus(streams["train"], streams["val"], dtype, tokenizer.vocab_size, tokenizer.eos_id)
