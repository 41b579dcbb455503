"""The search space of ``hydra/sweeper=optuna``: Hydra's sweep syntax -> Optuna distributions and fixed values.

The syntax is Hydra's own, on the command line or in ``hydra.sweeper.params``: ``choice(a,b)`` and ``a,b`` are
categorical, ``range(1,8)`` of integers is an integer range (ordered, so TPE can model it; of floats it is a
choice), ``interval(lo,hi)`` a float and ``int(interval(lo,hi))`` an integer interval, ``tag(log, ...)`` samples
on a log scale. Anything else is fixed and keeps its type: a YAML ``null`` in ``hydra.sweeper.params`` reaches the
job as ``null``, never as the string ``"None"`` (what hydra-optuna-sweeper did). Imports Optuna, not torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.errors import OverrideParseException
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from disttrain.config.errors import ConfigError

SWEEP_HELP = "use choice(a,b), range(lo,hi[,step]), interval(lo,hi), int(interval(lo,hi)) or tag(log,interval(lo,hi))"


@dataclass(frozen=True)
class SearchSpace:
    """What Optuna samples (one distribution per key) and what every trial gets unchanged (typed values)."""

    distributions: dict[str, BaseDistribution] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)  # key -> value (None, bool, int, float, str, list, dict)
    fixed_lines: list[str] = field(default_factory=list)  # command-line overrides passed through as written

    def grid(self) -> dict[str, list[Any]]:
        """Every value of every key, for the grid sampler; ConfigError for a continuous interval."""
        out: dict[str, list[Any]] = {}
        for key, dist in self.distributions.items():
            if isinstance(dist, CategoricalDistribution):
                out[key] = list(dist.choices)
            elif isinstance(dist, IntDistribution) and not dist.log:
                out[key] = list(range(dist.low, dist.high + 1, dist.step))
            else:
                raise ConfigError(
                    key,
                    "is a continuous interval, which the grid sampler cannot enumerate",
                    f"list the values with choice(...) or range(...), or use hydra/sweeper/sampler=tpe (on {key})",
                )
        return out

    def grid_size(self) -> int:
        return math.prod(len(values) for values in self.grid().values())

    def job_overrides(self, params: dict[str, Any]) -> list[str]:
        """One trial's overrides: the command's fixed ones, the fixed params, then the sampled values."""
        typed = [format_override(k, v) for k, v in {**self.fixed, **params}.items()]
        return [*self.fixed_lines, *typed]


def distribution(key: str, override: Override) -> BaseDistribution:
    """The Optuna distribution of one sweep override (see the module doc)."""
    value = override.value()
    log = "log" in getattr(value, "tags", set())
    if isinstance(value, IntervalSweep):
        low, high = value.start, value.end
        if low >= high:
            raise ConfigError(key, f"interval({low}, {high}) is empty", f"write interval(lo,hi) with lo < hi ({key})")
        if log and low <= 0:
            raise ConfigError(key, f"a log interval must start above 0, got {low}", "use tag(log,interval(1e-5,1e-2))")
        if isinstance(low, int) and isinstance(high, int):
            return IntDistribution(low, high, log=log)
        return FloatDistribution(float(low), float(high), log=log)
    if isinstance(value, RangeSweep):
        start, stop, step = value.start, value.stop, value.step
        if all(isinstance(x, int) for x in (start, stop, step)) and step > 0 and not log:
            if stop <= start:
                raise ConfigError(key, f"range({start}, {stop}) is empty", "write range(lo,hi) with lo < hi")
            return IntDistribution(start, start + step * ((stop - 1 - start) // step), step=step)
    if isinstance(value, ChoiceSweep | RangeSweep):
        if log:
            raise ConfigError(key, "tag(log, ...) only applies to an interval", SWEEP_HELP)
        choices = list(override.sweep_iterator())
        if not choices:
            raise ConfigError(key, "lists no values", SWEEP_HELP)
        for choice in choices:
            if not (choice is None or isinstance(choice, str | int | float | bool)):
                raise ConfigError(key, f"choice {choice!r} is not a plain value", "list plain values in choice(...)")
        return CategoricalDistribution(choices)
    raise ConfigError(key, f"cannot be sampled: {override.input_line}", SWEEP_HELP)


def parse_override(key: str, value: Any) -> Override:
    text = value if isinstance(value, str) else format_value(value)
    try:
        return OverridesParser.create().parse_overrides([f"{key}={text}"])[0]
    except OverrideParseException as err:
        raise ConfigError(key, f"cannot read '{text}' ({str(err).splitlines()[-1]})", SWEEP_HELP) from None


def build_search_space(command: list[Override], params: dict[str, Any] | None) -> SearchSpace:
    """The space from the command's overrides and ``hydra.sweeper.params`` (the command wins on a shared key)."""
    distributions: dict[str, BaseDistribution] = {}
    fixed: dict[str, Any] = {}
    for key, value in (params or {}).items():
        if isinstance(value, str):
            override = parse_override(key, value)
            if override.is_sweep_override():
                distributions[key] = distribution(key, override)
            else:
                fixed[key] = override.value()
        else:  # a YAML value: its type is the user's (null, a number, a list), never re-read as a string
            fixed[key] = value
    lines = []
    for override in command:
        key = override.get_key_element()
        distributions.pop(key, None)
        fixed.pop(key, None)
        if override.is_sweep_override():
            if override.is_hydra_override():
                raise ConfigError(key, "Hydra's own settings cannot be sampled", "give it a single value")
            distributions[key] = distribution(key, override)
        else:
            lines.append(override.input_line)
    return SearchSpace(distributions, fixed, lines)


def format_value(value: Any) -> str:
    """``value`` in Hydra's override grammar, reading back as the same type (a string that would read as a
    number, null or a bool is quoted)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # 0.001, 1e-05, inf, nan: all read back as the same number
    if isinstance(value, list | tuple):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{format_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    try:
        plain = OverridesParser.create().parse_overrides([f"k={text}"])[0]
        if not plain.is_sweep_override() and plain.value() == text:
            return text
    except OverrideParseException:
        pass
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def format_override(key: str, value: Any) -> str:
    return f"{key}={format_value(value)}"
