"""The package reads as one-way floors: cli -> commands (train, serve, generate) -> interop, images -> model -> ops.

Parsed from the source (ast), so a change that adds an upward or sideways import fails here, naming the arrow.
A module may import from a strictly lower floor or from its own top-level package; train and serve, on one
floor, never import each other. Nothing under model/ or ops/ reads the environment (the CLI turns environment
variables into explicit arguments).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "openk3"

FLOORS = {  # top-level module or package -> floor
    "ops": 0, "config": 0, "checkpoints": 0, "tokenizer": 0,
    "sampling": 0.5,  # its GPU path is an ops kernel
    "cache": 1,
    "model": 2,
    "quant": 2.5,
    "interop": 3, "cli_options": 3, "parallel": 3, "images": 3,
    "draft": 3.5, "build": 3.5,
    "generate": 4, "info": 4,
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
