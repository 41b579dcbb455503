"""The one error type a user's mistake turns into.

Every invalid value or combination becomes a ``ConfigError`` that names the offending key and the fix;
the pipelines print it as a single line and exit with code 2, before any process is spawned.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

USER_ERROR_EXIT_CODE = 2


class ConfigError(ValueError):
    """A user-facing configuration error: ``key`` is the dotted config path, ``fix`` how to repair it."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        self.key = key
        self.problem = problem
        self.fix = fix
        super().__init__(f"{key}: {problem}. Fix: {fix}")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """A ' (did you mean X?)' hint when ``word`` is a near miss of one of ``choices``, else ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def require_positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    """Refuse a negative (or, unless ``allow_zero``, a zero) ``value`` of ``key``."""
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(key, f"must be {bound}, got {value}", f"set {key} to a value {bound}")


def require_one_of(key: str, value: str | None, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(key, f"'{value}' is not one of {list(choices)}", f"use {key}={choices[0]}")
