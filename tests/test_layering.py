"""The package reads as one-way floors: cli -> commands (train, serve, generate) -> interop, images -> model -> ops.

Parsed from the source (ast), so a change that adds an upward or sideways import fails here, naming the arrow.
A module may import from a strictly lower floor or from its own top-level package; train and serve, on one
floor, never import each other. A command module (cli.COMMANDS: `openk3 X`'s parser and runner) is imported by
no other module: what two commands share lives below them (the decode loop in openk3.generation, shared options
in openk3.cli_options). No two modules import each other, directly or around a circle, not even lazily inside a
function. Nothing under model/ or ops/ reads the environment (the CLI turns environment variables into explicit
arguments).
"""

from __future__ import annotations

import ast
from pathlib import Path

from openk3.cli import COMMANDS

SRC = Path(__file__).resolve().parents[1] / "src" / "openk3"

FLOORS = {  # top-level module or package -> floor
    "ops": 0, "config": 0, "checkpoints": 0, "tokenizer": 0,
    "sampling": 0.5,  # its GPU path is an ops kernel
    "cache": 1,
    "model": 2,
    "quant": 2.5,
    "interop": 3, "cli_options": 3, "parallel": 3, "images": 3, "generation": 3, "accounting": 3,
    "draft": 3.5, "build": 3.5,
    "generate": 4, "info": 4, "export": 4,
    "train": 5, "serve": 5,
    "cli": 6, "__main__": 7,
}


def modules():
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        yield path, parts[0], ast.parse(path.read_text(), filename=str(path))


def openk3_imports(tree: ast.AST, package_parts: tuple[str, ...]):
    """(line, top-level openk3 name) of every import of openk3, relative imports resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                names = [".".join(("openk3", *base, node.module or ""))]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "openk3" and len(parts) > 1 and parts[1]:
                yield node.lineno, parts[1]


def test_every_module_has_a_floor():
    unknown = {top for _, top, _ in modules() if top not in FLOORS and top != "__init__"}
    assert not unknown, f"place these in FLOORS (tests/test_layering.py): {sorted(unknown)}"


def test_imports_go_down_the_floors():
    arrows = []
    for path, top, tree in modules():
        if top == "__init__":
            continue
        parts = path.relative_to(SRC).with_suffix("").parts
        for line, target in openk3_imports(tree, parts[:-1]):
            if target != top and FLOORS.get(target, 99) >= FLOORS[top]:
                arrows.append(f"{path.relative_to(SRC.parent)}:{line}: {top} -> {target}")
    assert not arrows, "imports against the floors:\n" + "\n".join(arrows)


def test_model_and_ops_read_no_environment():
    reads = []
    for path, top, tree in modules():
        if top not in ("model", "ops"):
            continue
        for node in ast.walk(tree):
            env = (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                   and node.attr in ("environ", "getenv", "putenv"))
            env |= isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                a.name in ("environ", "getenv") for a in node.names)
            if env:
                reads.append(f"{path.relative_to(SRC.parent)}:{node.lineno}")
    assert not reads, "environment read below the CLI: " + ", ".join(reads)


def test_the_checker_sees_a_planted_arrow(tmp_path):
    """The import walk finds absolute and relative imports (so an empty result above means something)."""
    tree = ast.parse("from openk3.serve.engine import Engine\nfrom ..serve import api\nimport openk3.train.loop\n")
    assert [t for _, t in openk3_imports(tree, ("train",))] == ["serve", "serve", "train"]


def module_name(path: Path) -> str:
    parts = ("openk3", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST, package: str, known: set[str]):
    """(line, module) for every openk3 module `tree` imports, anywhere in it (a function's lazy import too), relative
    imports resolved against `package`: `from a.b import c` names a.b, and a.b.c where that is a module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])])
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for name in names:
            if name in known:
                yield node.lineno, name


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """module -> {imported module: line} over `sources` (module -> (source text, is a package's __init__))."""
    known = set(sources)
    graph = {}
    for name, (text, is_package) in sources.items():
        package = name if is_package else name.rpartition(".")[0]
        graph[name] = {target: line for line, target in imported_modules(ast.parse(text), package, known)
                       if target != name}
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import circles: one path per group of modules that reach each other, as a -> b -> ... -> a (iterative
    Tarjan's strongly connected components, then a path around each)."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return [circle_through(graph, group) for group in groups]


def circle_through(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """A shortest path a -> ... -> a inside a group of mutually reachable modules (breadth first from its smallest
    name)."""
    start = min(group)
    previous: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    path = [start]
                    while node is not None:
                        path.append(node)
                        node = previous[node]
                    return path[::-1]
                if target in group and target not in previous:
                    previous[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no circle through {sorted(group)}")


def package_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(path): (path.read_text(), path.name == "__init__.py") for path in sorted(SRC.rglob("*.py"))}


def test_no_module_imports_a_command():
    commands = {module for module, _ in COMMANDS}
    graph = import_graph(package_sources())
    arrows = [f"{name} -> {target} (line {line})" for name, targets in graph.items() for target, line in targets.items()
              if target in commands]
    assert not arrows, "a command imported by another module (move what they share below both):\n" + "\n".join(arrows)


def test_no_import_cycles():
    found = cycles(import_graph(package_sources()))
    assert not found, "modules that import each other:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_cycle_finder_sees_planted_circles():
    """A circle through a lazy import and a relative one, a direct pair and a package's __init__, beside a diamond
    (no circle): each circle found once, as a path back to its start."""
    sources = {
        "openk3.a": ("from openk3 import b\n", False),
        "openk3.b": ("def f():\n    from openk3.c import x\n", False),
        "openk3.c": ("from . import a\n", False),
        "openk3.p": ("from openk3.p.q import y\n", True),
        "openk3.p.q": ("from openk3.p import z\n", False),
        "openk3.d": ("import openk3.e\nimport openk3.f\n", False),
        "openk3.e": ("import openk3.g\n", False),
        "openk3.f": ("import openk3.g\n", False),
        "openk3.g": ("", False),
    }
    found = sorted(cycles(import_graph(sources)))
    assert found == [["openk3.a", "openk3.b", "openk3.c", "openk3.a"], ["openk3.p", "openk3.p.q", "openk3.p"]]
