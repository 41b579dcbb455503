"""The final config of a tune as a Hydra experiment file: ``python -m train experiment=<name>`` reproduces it.

Group choices become ``defaults: - override /group: option``; ``key=value`` and ``+key=value`` become nested
values (an experiment is ``@package _global_``). A deletion (``~key``) has no experiment form: then only the
override line reproduces the config, and ``experiment_yaml`` says so by returning None.
"""

from __future__ import annotations

from typing import Any

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType

HEADER = "# @package _global_\n"


def _nested(target: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        target = target.setdefault(part, {})
    target[leaf] = value


def experiment_yaml(overrides: list[str], groups: set[str], note: str) -> str | None:
    """An experiment file equivalent to ``python -m train OVERRIDES`` (``groups``: the config groups of conf/),
    or None when an override cannot be written as one."""
    defaults: list[dict[str, str]] = []
    values: dict[str, Any] = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if key.startswith("hydra") or override.type == OverrideType.DEL or override.package is not None:
            return None
        if key in groups:
            defaults.append({f"override /{key}": str(override.value())})
        else:
            _nested(values, key, override.value())
    body: dict[str, Any] = {"defaults": defaults} if defaults else {}
    body.update(values)
    comment = "".join(f"# {line}\n" for line in note.splitlines())
    return HEADER + comment + yaml.safe_dump(body, sort_keys=False, default_flow_style=False)
