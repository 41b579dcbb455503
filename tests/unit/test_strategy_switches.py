"""No new switch on a strategy's name outside the strategies' own code, read from the source.

A switch is a comparison with a strategy's name (``cfg.strategy.name == "fsdp"``, ``strategy in ("ddp", "fsdp")``)
or a dict keyed by strategy names. Inside ``src/disttrain/strategies/`` (each strategy's spec and builder),
``src/disttrain/planner/terms/`` (each strategy's planner terms) and the strategy group's schema they are the point;
anywhere else each one is a place a new strategy must be added by hand (docs/extension.md). ``KNOWN`` holds
today's, per file: a new one fails, and so does a file with fewer than listed (the list shrinks as the diagnosis's
rules move into the strategies' specs, issue 66).
"""

from __future__ import annotations

import ast
from collections import Counter

from tests.conftest import REPO

NAMES = {"ddp", "fsdp", "deepspeed", "megatron"}
AUTO = "auto"  # also a value of other keys (``dp: auto``, ``format: auto``): a switch only beside a strategy
OWNERS = ("src/disttrain/strategies/", "src/disttrain/planner/terms/", "src/disttrain/config/strategy_schema.py")
ROOTS = ("src/disttrain", "diagnostics", "pipelines")
KNOWN = {
    "diagnostics/analysis/comm_split.py": 7,
    "diagnostics/analysis/context.py": 1,
    "diagnostics/analysis/step_measures.py": 1,
    "diagnostics/collect/callback.py": 1,
    "diagnostics/kinds/comm_bound.py": 6,
    "diagnostics/kinds/expert_imbalance.py": 1,
    "diagnostics/kinds/levers.py": 1,
    "diagnostics/kinds/low_overlap.py": 8,
    "diagnostics/kinds/memory_pressure.py": 5,
    "diagnostics/kinds/pipeline_bubble.py": 1,
    "src/disttrain/checkpoint/compat.py": 1,
    "src/disttrain/config/degrees.py": 1,
    "src/disttrain/config/parse.py": 1,
    "src/disttrain/config/schema.py": 2,
    "src/disttrain/config/validate.py": 3,
}


def _names(node: ast.AST, text: str) -> bool:
    allowed = NAMES | ({AUTO} if "strateg" in text.lower() else set())
    if isinstance(node, ast.Constant):
        return node.value in allowed
    if isinstance(node, ast.Tuple | ast.Set | ast.List) and node.elts:
        return all(isinstance(e, ast.Constant) and e.value in allowed for e in node.elts)
    return False


def switches(source: str) -> int:
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            text = ast.unparse(node)
            count += any(_names(part, text) for part in (node.left, *node.comparators))
        elif isinstance(node, ast.Dict):
            keys = [k for k in node.keys if isinstance(k, ast.Constant)]
            count += sum(k.value in NAMES for k in keys) >= 2
    return count


def found() -> Counter[str]:
    out: Counter[str] = Counter()
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if not rel.startswith(OWNERS) and (n := switches(path.read_text(encoding="utf-8"))):
                out[rel] = n
    return out


def test_no_new_switch_on_a_strategy_name_outside_the_strategies() -> None:
    now = found()
    grown = {f: (KNOWN.get(f, 0), n) for f, n in now.items() if n > KNOWN.get(f, 0)}
    assert not grown, f"new strategy-name switches (known, now): {grown}; put the rule in the strategy's spec"
    shrunk = {f: (n, now.get(f, 0)) for f, n in KNOWN.items() if now.get(f, 0) < n}
    assert not shrunk, f"fewer switches than KNOWN lists (known, now): {shrunk}; lower KNOWN"


def test_a_switch_is_seen_in_each_form() -> None:
    forms = {
        'if cfg.strategy.name == "fsdp": pass': 1,
        'ok = strategy in ("ddp", "fsdp")': 1,
        'terms = {"ddp": 1, "deepspeed": 2}': 1,
        'if cfg.strategy.name == "auto": pass': 1,
        'if cfg.dp == "auto": pass': 0,  # another key's value
        'x = {"ddp": 1}': 0,
    }
    for source, expected in forms.items():
        assert switches(source) == expected, source
