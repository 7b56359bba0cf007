"""The package's shape: its folders are layers, each importing only the layers below it (lazy imports
included), no module imports one that imports it back, every function is short enough to hold in your head,
and no module does so many jobs that it grows past 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "minigpt"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 600
LAYERS = (
    ("runtime",),
    ("optim",),
    ("config",),
    ("parallel",),
    ("nn", "data"),
    ("training",),
    ("inference", "hf", "tools"),
    ("app", "serve"),
    ("commands",),
    ("cli",),
)
"""minigpt's packages, bottom to top: a module imports its own package and the floors below its own. Packages
on one floor are siblings that import nothing of each other. docs/contributing.md draws the same floors."""


def _module_name(path: Path) -> str:
    """src/minigpt/data/store.py -> 'data.store'; a package's __init__.py is named for the package."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "minigpt"


def _trees() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(node: ast.AST) -> set[str]:
    """The minigpt modules one import statement names: `from minigpt.data import store` -> data, data.store."""
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "minigpt":
        base = node.module.removeprefix("minigpt").lstrip(".")
        return {base} | {f"{base}.{a.name}".lstrip(".") for a in node.names}
    if isinstance(node, ast.Import):
        return {a.name.removeprefix("minigpt.") for a in node.names if a.name.startswith("minigpt.")}
    return set()


def import_graph() -> dict[str, set[str]]:
    """module -> the minigpt modules it imports anywhere in its file (top level or inside functions)."""
    trees = _trees()
    graph: dict[str, set[str]] = {}
    for name, tree in trees.items():
        deps = set().union(*(_imported(node) for node in ast.walk(tree)))
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


def _floor(module: str) -> int:
    package = module.split(".")[0]
    return next(i for i, floor in enumerate(LAYERS) if package in floor)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a.x -> b.y' for every import of a module on the same floor in another package, or on a higher floor."""
    return [
        f"{name} -> {dep}"
        for name, deps in sorted(graph.items())
        for dep in sorted(deps)
        if dep.split(".")[0] != name.split(".")[0] and _floor(dep) >= _floor(name)
    ]


def test_every_module_lives_in_a_layer() -> None:
    loose = [name for name in import_graph() if name != "minigpt" and "." not in name and name not in {"cli"}]
    assert all(name in {p for floor in LAYERS for p in floor} for name in loose), loose
    top = {p.name for p in PACKAGE.iterdir() if p.suffix == ".py"}
    assert top == {"__init__.py", "cli.py"}, top  # no loose module but the package and the entry point
    for package in (p for floor in LAYERS for p in floor if p != "cli"):
        init = PACKAGE / package / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), (
            f"{package}/__init__.py says what the layer owns"
        )


def test_no_import_climbs_back_up() -> None:
    graph = import_graph()
    assert {
        "app.train",
        "training.trainer",
        "parallel.sharding",
        "parallel.distributed",
        "data.store",
    } <= graph.keys()
    assert not upward_imports(graph), upward_imports(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_layer_check_finds_an_upward_import() -> None:
    assert upward_imports({"nn.model": {"training.trainer"}, "training.trainer": set()}) == [
        "nn.model -> training.trainer"
    ]
    assert upward_imports({"hf.export": {"tools.plan"}, "tools.plan": set()}) == ["hf.export -> tools.plan"]
    assert not upward_imports({"training.trainer": {"nn.model", "training.hardware"}})


def test_the_cycle_check_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_function_is_longer_than_60_lines() -> None:
    long = [
        f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for name, tree in _trees().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, long


def test_no_module_is_longer_than_600_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, long
