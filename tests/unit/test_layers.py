"""The package's imports point down and go in no circle, read from the source with
``ast`` (nothing is run).

The layers, lowest first (the same order as in docs/architecture.md):

    protos  <-  workers  <-  scheduler  <-  cluster

A module may import its own layer and the layers below it, never one above: not at
module level, not inside a function, not under ``TYPE_CHECKING``. A type two layers
share lives in the lower one. The import graph between modules has no cycle, type-only
imports included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("protos", "workers", "scheduler", "cluster")  # lowest first


def _modules() -> dict[str, Path]:
    """Every module of the package by its import name (``tessera.workers.kv.manager``)."""
    modules = {}
    for folder in LAYERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(("tessera", *parts))] = path
    return modules


MODULES = _modules()


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every ``tessera`` module this file imports, anywhere in it.
    ``from tessera.x import y`` counts as importing ``tessera.x.y`` when that is a
    module, else ``tessera.x``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in MODULES
                else node.module
                for alias in node.names
            ]
        else:
            continue
        found += [(node.lineno, name) for name in names if name.split(".")[0] == "tessera"]
    return found


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def test_every_module_belongs_to_a_layer():
    assert MODULES, "no modules found"
    for module in MODULES:
        assert module.split(".")[1] in LAYERS


def test_imports_point_down():
    upward = sorted(
        {
            f"{path.relative_to(ROOT)}:{line} ({LAYERS[_layer(module)]}) imports {target} "
            f"({LAYERS[_layer(target)]})"
            for module, path in MODULES.items()
            for line, target in _imports(path)
            if _layer(target) > _layer(module)
        }
    )
    assert upward == [], "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_every_import_names_a_module_that_exists():
    """A moved module leaves no stale import behind (which the layer check would miss)."""
    missing = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in MODULES.values()
        for line, target in _imports(path)
        if target not in MODULES
    ]
    assert missing == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), or a
    module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph[node]:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_no_import_cycles():
    graph = {
        module: {
            target
            for _, target in _imports(path)
            if target in MODULES and not module.startswith(target + ".")  # a parent package
        }
        for module, path in MODULES.items()
    }
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_cycles():
    """The check above can fail: a two-module circle and a self-import are found."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"a"}}) == [["a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
