"""The package's shape: no import circles, Ray named only behind the engine seam, modules and
classes of a readable size, benchmarks on public names only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rollout_lifecycle"
MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 400
#: One concern each, larger than the module limit (a whole SGLang stand-in server).
LARGE_MODULES = {"testing/standin.py"}
PUBLIC = {"rollout_lifecycle", "rollout_lifecycle.testing", "rollout_lifecycle.sync"}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def runtime_imports(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports when it is imported (not under TYPE_CHECKING, not
    inside functions)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if isinstance(node, ast.Try | ast.If) else [node]:
            if isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                base = sub.module
                for alias in sub.names:
                    full = f"{base}.{alias.name}"
                    out.add(full if full in known else base)
            elif isinstance(sub, ast.Import):
                out.update(a.name for a in sub.names)
    return {m for m in out if m in known}


def test_no_import_circles() -> None:
    found = modules()
    known = set(found)
    graph = {name: runtime_imports(path, known) - {name} for name, path in found.items()}
    # a package's __init__ importing its own modules is not a circle of theirs
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_ray_is_named_only_behind_the_engine_seam() -> None:
    for name, path in modules().items():
        if not name.startswith("rollout_lifecycle.core"):
            continue
        assert "ray" not in {
            (n.module or "").split(".")[0]
            if isinstance(n, ast.ImportFrom)
            else a.name.split(".")[0]
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Import | ast.ImportFrom)
            for a in (n.names if isinstance(n, ast.Import) else [n])  # type: ignore[list-item]
        }, f"{name} imports ray"


def test_modules_and_classes_stay_readable() -> None:
    for path in modules().values():
        rel = str(path.relative_to(PACKAGE))
        lines = path.read_text().count("\n")
        if rel not in LARGE_MODULES:
            assert lines <= MAX_MODULE_LINES, f"{rel} has {lines} lines"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                assert size <= MAX_CLASS_LINES, f"{rel}: class {node.name} has {size} lines"


def test_benchmarks_and_examples_import_public_names_only() -> None:
    for folder in ("benchmarks", "examples"):
        for path in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "rollout_lifecycle"
                ):
                    assert node.module in PUBLIC, f"{path.name} imports {node.module}"
