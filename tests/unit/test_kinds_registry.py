"""The finding kinds' one registry: every kind of ``ORDER`` is a module of diagnostics/kinds with its ``detect`` and
``recommend``, and every module there is a kind or one of the shared lever modules."""

from __future__ import annotations

import inspect
from importlib import import_module

import pytest

from diagnostics.analysis.finding import Finding
from diagnostics.kinds import ORDER
from diagnostics.kinds.registry import REGISTRY
from tests.conftest import REPO

SHARED = {"__init__", "registry", "levers", "comm_levers", "needs"}  # not kinds: what the kinds' modules share


def test_every_kind_has_its_module_and_every_module_is_a_kind() -> None:
    modules = {path.stem for path in (REPO / "diagnostics" / "kinds").glob("*.py")} - SHARED
    assert modules == set(ORDER)
    assert list(REGISTRY) == list(ORDER)
    for name, kind in REGISTRY.items():
        assert kind.detect.__module__ == kind.recommend.__module__ == f"diagnostics.kinds.{name}"
        assert list(inspect.signature(kind.detect).parameters) == ["run", "summary", "phases"]
        assert list(inspect.signature(kind.recommend).parameters) == ["finding", "ctx"]


def test_a_finding_of_a_kind_outside_the_registry_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown finding kind 'slow_disk'"):
        Finding("slow_disk", "info", [0], {}, "x")


def test_each_threshold_has_one_home_and_reaches_the_report() -> None:
    from diagnostics.analysis import thresholds as shared
    from diagnostics.report.model import thresholds

    names = [name for kind in REGISTRY.values() for name in kind.thresholds]
    assert len(names) == len(set(names)), "a threshold named by two kinds"
    assert not set(names) & set(vars(shared)), "a kind's threshold also in analysis/thresholds.py"
    for kind in REGISTRY.values():
        for name, value in kind.thresholds.items():
            assert thresholds()[name] == value == getattr(import_module(f"diagnostics.kinds.{kind.name}"), name)
