"""The layering contract (docs/architecture.md, ../shared/DESIGN.md), read from the source's import statements.

- Inside ``disttrain`` a folder imports only folders below it in ``ORDER`` (config at the bottom, job at the top).
  ``KNOWN_UPWARD`` would list accepted exceptions (none today): a new one fails, and so does a listed one that is
  gone (the list must shrink with the code).
- ``diagnostics`` never imports ``disttrain`` (a run dir is diagnosed on a laptop without it); its pure parts (all
  but ``collect``, which runs inside the ranks) import neither torch nor Lightning, not even inside a function.
- No import cycle between files, through module-level imports or imports inside functions (``KNOWN_CYCLES``
  would list accepted ones: none today).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ORDER = [
    "config",
    "planner",
    "models",
    "data",
    "launch",
    "checkpoint",
    "reliability",
    "strategies",
    "sweep",
    "training",
    "job",
    "tune",  # drives whole runs and their A/B tests (diagnostics.ab) from above
]
KNOWN_UPWARD: set[tuple[str, str]] = set()  # none left: a new one fails
KNOWN_CYCLES: set[frozenset[str]] = set()  # none left: a new one fails
FRAMEWORKS = ("torch", "lightning", "pytorch_lightning")


def modules() -> dict[str, Path]:
    out = {}
    for base in (REPO / "src" / "disttrain", REPO / "diagnostics"):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            parts = parts[1:] if parts[0] == "src" else parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, top_level_only: bool = False) -> Iterator[str]:
    """Every module name an import statement of ``path`` names (``from a import b`` names ``a`` and ``a.b``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "disttrain" and len(parts) > 1 and parts[1] in ORDER else None


def test_every_disttrain_folder_has_its_place_in_the_order() -> None:
    folders = {p.name for p in (REPO / "src" / "disttrain").iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(ORDER), f"place a new folder in ORDER (or drop a gone one): {sorted(folders ^ set(ORDER))}"


def test_disttrain_folders_import_only_downward() -> None:
    upward = set()
    for module, path in modules().items():
        here = folder(module)
        for name in imports(path):
            there = folder(name)
            if here and there and ORDER.index(there) > ORDER.index(here):
                upward.add((here, there))
    new = sorted(upward - KNOWN_UPWARD)
    assert not new, f"upward imports (a folder importing one above it in ORDER): {new}"
    gone = sorted(KNOWN_UPWARD - upward)
    assert not gone, f"listed upward imports that no longer exist; remove them from KNOWN_UPWARD: {gone}"


def test_diagnostics_never_import_disttrain_and_its_pure_parts_no_framework() -> None:
    bad = []
    for module, path in modules().items():
        if not module.startswith("diagnostics"):
            continue
        pure = not module.startswith("diagnostics.collect")
        for name in imports(path):
            root = name.split(".")[0]
            if root == "disttrain" or (pure and root in FRAMEWORKS):
                bad.append(f"{module} imports {name}")
    assert not bad, bad


def cycles(top_level_only: bool) -> set[frozenset[str]]:
    """The strongly connected groups of files (more than one file) in the import graph."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in mods.items():
        for name in imports(path, top_level_only):
            target = resolve(name)
            if target and target != module and not module.startswith(target + "."):  # not its own package
                graph[module].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                found.add(frozenset([v, *group]))

    for module in list(mods):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle_between_files() -> None:
    assert cycles(top_level_only=True) == set()
    hidden = cycles(top_level_only=False)
    new = hidden - KNOWN_CYCLES
    assert not new, f"import cycles through imports inside functions: {[sorted(c) for c in new]}"
    gone = KNOWN_CYCLES - hidden
    assert not gone, f"listed cycles that no longer exist; remove them from KNOWN_CYCLES: {[sorted(c) for c in gone]}"


def test_imports_are_read_from_module_level_and_inside_functions(tmp_path: Path) -> None:
    """What the checks read: both kinds of import, ``from a import b`` as ``a`` and ``a.b``; job ranks above config."""
    source = tmp_path / "m.py"
    source.write_text("from disttrain.job.run import x\n\ndef f():\n    import torch\n")
    assert list(imports(source)) == ["disttrain.job.run", "disttrain.job.run.x", "torch"]
    assert list(imports(source, top_level_only=True)) == ["disttrain.job.run", "disttrain.job.run.x"]
    assert ORDER.index(folder("disttrain.job.run")) > ORDER.index(folder("disttrain.config.schema"))
