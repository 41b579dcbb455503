"""Keep credentials out of everything a run writes (config.yaml, run.json, Hydra's record, the report).

A config can pull a secret in through an interpolation (``+model.token=${oc.env:HF_TOKEN}`` for a custom model
that downloads weights) or name one literally; resolved, it would land in the saved config, the manifest and
the report built from it. Two rules: a value of an environment variable whose name says it is a credential
(``WANDB_API_KEY``, ``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``, ...) is replaced wherever it appears, and a config
key named like a credential (``api_key``, ``token``, ``password``, ...) has its value replaced.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from diagnostics.files import write_text_atomic

# Whole words of a name (split at _ - . and camelCase): HF_TOKEN and api_key are credentials,
# data.num_train_tokens, keep_last_n and tokenizer are not.
CREDENTIAL_WORDS = frozenset(
    {"key", "apikey", "token", "secret", "password", "passwd", "credential", "credentials", "auth", "pat"}
)
WORD_SPLIT = re.compile(r"[_\-.\s]+|(?<=[a-z0-9])(?=[A-Z])")
# Shorter values ("1", "true") are flags, not secrets, and replacing them would mangle unrelated text.
MIN_SECRET_LENGTH = 8
REDACTED = "<redacted>"


def is_credential_name(name: str) -> bool:
    return any(word.lower() in CREDENTIAL_WORDS for word in WORD_SPLIT.split(name.lstrip("+~")))


def secret_values(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Credential-like environment variables: value -> name (longest first, so overlaps redact whole)."""
    env = os.environ if environ is None else environ
    found = {v: k for k, v in env.items() if is_credential_name(k) and len(v) >= MIN_SECRET_LENGTH}
    return dict(sorted(found.items(), key=lambda item: -len(item[0])))


# An override ``+model.api_token=...`` (alone, or inside Hydra's comma-joined ``override_dirname``): the value
# of a credential-named key goes, the key stays.
ASSIGNMENT = re.compile(r"(?P<key>[\w.+~-]+)=(?P<value>[^,\s]+)")


def _assignment(match: re.Match[str]) -> str:
    key = match["key"]
    return f"{key}={REDACTED}" if is_credential_name(key.rsplit(".", 1)[-1]) else match[0]


def redact_text(text: str, secrets: Mapping[str, str]) -> str:
    text = ASSIGNMENT.sub(_assignment, text)
    for value, name in secrets.items():
        if value in text:
            text = text.replace(value, f"<redacted ${name}>")
    return text


def redact(value: Any, secrets: Mapping[str, str] | None = None) -> Any:
    """A copy of ``value`` (dicts, lists, strings, dataclass-free JSON-like data) with credentials replaced."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(value, str):
        return redact_text(value, secrets)
    if isinstance(value, Mapping):
        return {
            k: REDACTED
            if isinstance(k, str) and is_credential_name(k) and isinstance(v, str) and v
            else redact(v, secrets)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return type(value)(redact(v, secrets) for v in value)
    return value


def redact_yaml_files(paths: list[Path], secrets: Mapping[str, str] | None = None) -> None:
    """Rewrite YAML files that others wrote (Hydra's ``.hydra/*.yaml``) without credentials; untouched if clean."""
    secrets = secret_values() if secrets is None else secrets
    for path in paths:
        if not path.is_file():
            continue
        loaded = yaml.safe_load(path.read_text())
        clean = redact(loaded, secrets)
        if clean != loaded:
            write_text_atomic(path, yaml.safe_dump(clean, sort_keys=False))
