"""The trainer's lever catalogue (config/levers.py) covers every key the diagnosis recommends, tune classifies by it,
and run.json carries it to a report rendered off the training machine."""

from __future__ import annotations

import ast
import json

from diagnostics.manifest import RunManifest
from disttrain.config.levers import BY_KEY, CATALOGUE, PRESERVING, catalogue_record
from disttrain.tune.levers import KEY_CLASSES, classify
from tests.conftest import REPO


def recommended_keys_in_source() -> dict[str, str]:
    """The key of every ``lever("<key>", ...)`` call in diagnostics/ whose first argument is a config key."""
    found: dict[str, str] = {}
    for path in sorted((REPO / "diagnostics").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "lever"):
                continue
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and " " not in first.value:
                found[first.value.lstrip("+~")] = path.relative_to(REPO).as_posix()
    return found


def recommended_keys_in_golden_reports() -> dict[str, str]:
    """The key of every override the kept reports (tests/golden/reports) recommend."""
    found: dict[str, str] = {}

    def walk(value: object, name: str) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                if key == "override" and isinstance(inner, str):
                    for token in inner.split():
                        if "=" in token:
                            found[token.split("=", 1)[0].lstrip("+~")] = name
                walk(inner, name)
        elif isinstance(value, list):
            for inner in value:
                walk(inner, name)

    for path in sorted((REPO / "tests" / "golden" / "reports").glob("*.json")):
        walk(json.loads(path.read_text(encoding="utf-8")), path.name)
    return found


def test_every_key_the_diagnosis_recommends_is_in_the_catalogue() -> None:
    source, golden = recommended_keys_in_source(), recommended_keys_in_golden_reports()
    assert len(source) >= 25 and len(golden) >= 15  # the scans see the recommenders (29 and 21 when written)
    missing = {key: where for key, where in {**source, **golden}.items() if key not in BY_KEY}
    assert not missing, f"recommended keys missing from config/levers.py CATALOGUE: {missing}"


def test_the_catalogue_is_one_entry_per_key_and_tune_classifies_by_it() -> None:
    assert len(BY_KEY) == len(CATALOGUE)
    assert {lever.key: lever.lever for lever in CATALOGUE} == KEY_CLASSES
    for lever in CATALOGUE:
        if lever.lever in ("comm_hook", "micro_batch"):  # classify refines these by value and the pinned batch
            continue
        got = classify(lever.key, "1", pinned=(), global_batch=None)
        assert got.name == lever.lever and got.preserves_math == (lever.lever in PRESERVING), lever
    assert classify("strategy.not_a_lever", "1", (), None).name == "other"


def test_run_json_carries_the_catalogue_and_reads_it_back() -> None:
    record = catalogue_record()
    assert {r["key"] for r in record} == set(BY_KEY)
    assert all(r["keeps_math"] == (r["lever"] in PRESERVING) for r in record)
    back = RunManifest.from_json(json.loads(json.dumps(RunManifest(levers=record).to_json())))
    assert back.levers == record
    assert "levers" not in RunManifest().to_json()  # a run that never started records none
