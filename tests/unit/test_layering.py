"""The layering contract (docs/architecture.md, ../shared/DESIGN.md), read from the source's import statements.

- Inside ``disttrain`` a folder imports only folders below it in ``ORDER`` (config at the bottom, job at the top).
  ``KNOWN_UPWARD`` would list accepted exceptions (none today): a new one fails, and so does a listed one that is
  gone (the list must shrink with the code).
- ``diagnostics`` never imports ``disttrain`` (a run dir is diagnosed on a laptop without it); its pure parts (all
  but ``collect``, which runs inside the ranks) import neither torch nor Lightning, not even inside a function.
- No import cycle between files, through module-level imports or imports inside functions (``KNOWN_CYCLES``
  would list accepted ones: none today).
- An import of a project module inside a function is there to keep a heavy library (``DEFERRED``) off a path that
  does not need it: the module it imports pulls one in at import time that the importing module does not. Any
  other belongs at the top of the file, where a reader sees what the module depends on.
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
# What an import inside a function may defer: libraries whose import costs a light path (``python -m plan``,
# ``python -m diagnose``, the launcher before it starts the ranks) tenths of a second to seconds.
DEFERRED = {*FRAMEWORKS, "transformers", "datasets", "deepspeed", "optuna", "numpy", "torchao", "submitit", "wandb"}
PROJECT_ROOTS = ("src/disttrain", "diagnostics", "pipelines")


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


def project_modules() -> dict[str, Path]:
    """Every project module by import name; ``pipelines/`` files are top-level modules (``python -m train``)."""
    out = {}
    for root in PROJECT_ROOTS:
        for path in (REPO / root).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            parts = parts[1:] if parts[0] in ("src", "pipelines") else parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_time_names(path: Path) -> Iterator[str]:
    """Module names imported when ``path`` is imported: its module-level statements, inside ``try`` and ``if`` (not
    ``if TYPE_CHECKING``) and class bodies, not function bodies."""

    def walk(body: list[ast.stmt]) -> Iterator[ast.stmt]:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                yield from walk(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                yield from walk(node.body + node.orelse + node.finalbody)
                for handler in node.handlers:
                    yield from walk(handler.body)
            elif isinstance(node, ast.ClassDef):
                yield from walk(node.body)
            else:
                yield node

    for node in walk(ast.parse(path.read_text(encoding="utf-8")).body):
        yield from statement_names(node)


def statement_names(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        yield node.module
        yield from (f"{node.module}.{alias.name}" for alias in node.names)


class ImportClosure:
    """Which third-party libraries importing a project module imports, through every project module it imports
    at module level (and the packages above each)."""

    def __init__(self, mods: dict[str, Path]) -> None:
        self.mods = mods
        self.direct = {module: self._direct(module, path) for module, path in mods.items()}

    def project(self, name: str) -> list[str]:
        """The project modules importing ``name`` executes: each package on the way, then the module itself."""
        parts = name.split(".")
        return [m for i in range(1, len(parts) + 1) if (m := ".".join(parts[:i])) in self.mods]

    def _direct(self, module: str, path: Path) -> set[str]:
        out = set(self.project(module.rpartition(".")[0]))
        for name in import_time_names(path):
            out |= set(self.project(name)) or {f"ext:{name.split('.')[0]}"}
        return out

    def libraries(self, modules: list[str]) -> set[str]:
        seen: set[str] = set()
        stack = list(modules)
        while stack:
            if (current := stack.pop()) not in seen:
                seen.add(current)
                stack.extend(self.direct.get(current, ()))
        return {m.removeprefix("ext:") for m in seen if m.startswith("ext:")}


def needless_function_imports(mods: dict[str, Path], root: Path = REPO) -> list[str]:
    """Imports of project modules inside functions that defer none of ``DEFERRED`` (the importer has them anyway)."""
    closure = ImportClosure(mods)
    bad = []
    for module, path in mods.items():
        has = closure.libraries([module]) & DEFERRED
        for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                targets = [m for name in statement_names(node) for m in closure.project(name) if m != module]
                if targets and not closure.libraries(targets) & DEFERRED - has:
                    bad.append(f"{path.relative_to(root)}:{node.lineno} in {function.name}(): {ast.unparse(node)}")
    return bad


def test_imports_inside_functions_keep_a_heavy_library_off_a_light_path() -> None:
    bad = needless_function_imports(project_modules())
    assert not bad, "imports inside functions that defer no heavy library; move them to the top of the file:\n" + (
        "\n".join(bad)
    )


def test_a_function_import_is_needless_unless_it_defers_a_heavy_library(tmp_path: Path) -> None:
    """The rule on a made-up tree: ``light`` deferring ``heavy`` (torch) is kept, deferring ``plain`` is not, and
    ``heavy`` importing ``plain`` inside a function (torch is loaded anyway) is not either."""
    (tmp_path / "plain.py").write_text("import json\n")
    heavy = "try:\n    import torch\nexcept ImportError:\n    pass\n\ndef f():\n    import plain\n"
    (tmp_path / "heavy.py").write_text(heavy)
    (tmp_path / "light.py").write_text("def f():\n    import heavy\n\ndef g():\n    from plain import json\n")
    mods = {p.stem: p for p in tmp_path.glob("*.py")}
    bad = sorted(needless_function_imports(mods, tmp_path))
    assert bad == ["heavy.py:7 in f(): import plain", "light.py:5 in g(): from plain import json"]
