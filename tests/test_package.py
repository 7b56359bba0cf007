"""The package's shape: no module imports one that imports it back (lazy imports included), and every
function is short enough to hold in your head."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "minigpt"
MAX_FUNCTION_LINES = 60


def _trees() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.glob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """module -> the minigpt modules it imports anywhere in its file (top level or inside functions)."""
    trees = _trees()
    graph: dict[str, set[str]] = {}
    for name, tree in trees.items():
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "minigpt":
                base = node.module.removeprefix("minigpt").lstrip(".")
                deps |= {base} if base else {a.name for a in node.names}  # `from minigpt import sharding`
            elif isinstance(node, ast.Import):
                deps |= {a.name.removeprefix("minigpt.") for a in node.names if a.name.startswith("minigpt.")}
        graph[name] = {d for d in deps if d in trees and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A list of modules forming an import cycle, or None (depth-first search with colouring)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = import_graph()
    assert {"train", "trainer", "sharding", "distributed", "profiling"} <= graph.keys()
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
    assert not graph["config"] - {"optimizer", "errors", "files"}, graph[
        "config"
    ]  # config sits at the bottom
    assert "cli" not in set().union(*graph.values())  # nothing imports the command line


def test_the_cycle_check_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_function_is_longer_than_60_lines() -> None:
    long = [
        f"{name}.py:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for name, tree in _trees().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, long
