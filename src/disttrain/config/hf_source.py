"""Where a ``model=hf`` run's Hugging Face config comes from (a local directory or inline fields), checked and read.

Below the schema (which asks it for an HF model's vocabulary): it knows sources, not ``HFModelConfig``.
``transformers`` is imported lazily: it costs seconds, and only HF runs should pay them.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from disttrain.config.errors import ConfigError


def check_source(path: str | None, config: dict[str, Any] | None) -> None:
    """Exactly one of ``path`` / ``config``, and the path a local model directory."""
    if (path is None) == (config is None):
        raise ConfigError(
            "model.path",
            "model=hf needs exactly one of model.path (a local model directory) or model.config (inline fields)",
            "set model.path=/dir/with/config.json, or use a conf/model/hf-*.yaml with a config",
        )
    if path is not None:
        directory = Path(path).expanduser()
        if not (directory / "config.json").is_file():
            what = "does not exist" if not directory.exists() else "has no config.json"
            raise ConfigError(
                "model.path",
                f"'{path}' {what} (no hub access: only local directories are read)",
                "point model.path at a directory written by save_pretrained (config.json + *.safetensors)",
            )
    elif "model_type" not in config:  # type: ignore[operator]
        raise ConfigError("model.config.model_type", "is required", "add e.g. model.config.model_type=llama")


def read_source(path: str | None, config: dict[str, Any] | None) -> Any:
    """The ``transformers.PretrainedConfig`` of the source, checked first (cached per source)."""
    check_source(path, config)
    # The cache key: a dict is not hashable itself.
    return _load(json.dumps({"path": path, "config": config}, sort_keys=True))


@lru_cache(maxsize=16)
def _load(key: str) -> Any:
    from transformers import AutoConfig

    source = json.loads(key)
    try:
        if source["path"] is not None:
            return AutoConfig.from_pretrained(str(Path(source["path"]).expanduser()), local_files_only=True)
        fields = dict(source["config"])
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    except (ValueError, OSError, KeyError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        key_name = "model.path" if source["path"] is not None else "model.config"
        problem = f"transformers cannot read this config ({first})"
        raise ConfigError(key_name, problem, "check the config fields") from None
