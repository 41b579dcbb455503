"""The object a ``_target_`` dotted path names, imported, with one-line errors naming what is missing."""

from __future__ import annotations

import importlib

from disttrain.config.errors import ConfigError


def resolve_target(target: str, key: str) -> object:
    """The object a ``_target_`` dotted path names (a model factory, a datamodule class): the longest importable
    module prefix, then attributes. Failures are one line naming what is missing (Hydra's own lookup logs a
    three-line error of its own first)."""
    fix = "check the dotted path and that its package is importable (installed, or on PYTHONPATH)"
    parts = target.split(".")
    if not all(parts):
        raise ConfigError(key, f"'{target}' is not a dotted path (module.name)", fix)
    obj: object = None
    for end in range(len(parts), 0, -1):
        module = ".".join(parts[:end])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name is not None and module != err.name and not module.startswith(f"{err.name}."):
                raise ConfigError(key, f"importing '{module}' failed: {err}", fix) from None
            continue  # not a module at this length: a shorter prefix may be one
        except Exception as err:  # the user's module itself raised while importing
            raise ConfigError(key, f"importing '{module}' failed: {type(err).__name__}: {err}", fix) from None
        break
    else:
        raise ConfigError(key, f"cannot import '{target}': no module named '{parts[0]}'", fix)
    for depth, name in enumerate(parts[end:], start=end):
        if not hasattr(obj, name):
            raise ConfigError(key, f"cannot import '{target}': '{'.'.join(parts[:depth])}' has no '{name}'", fix)
        obj = getattr(obj, name)
    return obj
