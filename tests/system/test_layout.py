"""The package's shape: layers that import only downwards, no import circles, a core that loads
without Ray or httpx, modules and classes of a readable size, benchmarks on public names only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rollout_lifecycle"
MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 400
PUBLIC = {
    "rollout_lifecycle",
    "rollout_lifecycle.testing",
    "rollout_lifecycle.sync",
    "rollout_lifecycle.trainer",
}
#: Each layer may import the layers below it, never one beside or above it: the contract at the
#: bottom; the lifecycle core, the engine backends and the trainer-side fingerprints
#: (``trainer``) side by side over it (none knows another: backends register their seams); the
#: simulators and stand-ins (``testing``) and the blocking facade (``sync``) over those; the
#: command line at the top. The package's own ``__init__`` loads what it exports (the backends
#: lazily).
LAYERS = {
    "contract": 0,
    "core": 1,
    "backends": 1,
    "trainer": 1,
    "testing": 2,
    "sync": 2,
    "cli": 3,
}


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


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "rollout_lifecycle" else None


def all_imports(path: Path) -> set[str]:
    """Every package module ``path`` names in an import anywhere (inside functions too), but
    under ``TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("rollout_lifecycle.")}


def test_every_module_belongs_to_a_layer() -> None:
    for name in modules():
        if name != "rollout_lifecycle":
            assert layer_of(name) in LAYERS, f"{name} is in no layer of {sorted(LAYERS)}"


def test_layers_import_only_downwards_even_through_other_modules() -> None:
    found = modules()
    direct = {name: all_imports(path) for name, path in found.items()}
    for name in found:
        own = layer_of(name)
        if own is None:
            continue
        # Everything ``name`` reaches, through any chain of imports, stays below it.
        seen: dict[str, list[str]] = {name: [name]}
        stack = [name]
        while stack:
            here = stack.pop()
            for nxt in sorted(direct.get(here, set())):
                target = next((m for m in (nxt, nxt.rpartition(".")[0]) if m in found), None)
                if target is None or target in seen or layer_of(target) is None:
                    continue
                seen[target] = [*seen[here], target]
                stack.append(target)
                other = layer_of(target)
                assert other == own or LAYERS[other] < LAYERS[own], (  # type: ignore[index]
                    f"{own} imports {other}: " + " -> ".join(seen[target])
                )


def test_the_core_loads_without_ray_or_httpx() -> None:
    """With Ray and httpx unavailable, every core module imports, and so does the package (its
    backends load when first asked for)."""
    core = sorted(n for n in modules() if layer_of(n) in ("core", "contract"))
    script = (
        "import sys\n"
        "sys.modules['ray'] = None\n"
        "sys.modules['httpx'] = None\n"
        "import importlib\n"
        f"for name in {core!r}: importlib.import_module(name)\n"
        "import rollout_lifecycle\n"
        "from rollout_lifecycle import RolloutServer, EngineGroup, LifecycleConfig\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('rollout_lifecycle.backends'))\n"
        "print(len(loaded), loaded)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0 []", done.stdout
    # The blocking really blocks: a backend that needs Ray does not load.
    blocked = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['ray'] = None\nimport rollout_lifecycle.backends.actor",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert blocked.returncode != 0 and "ray" in blocked.stderr


def test_the_command_line_and_ctl_load_without_ray() -> None:
    """``ctl`` drives HTTP servers: building the command's parser and running ``ctl`` import no
    Ray (only ``demo`` needs it, when it runs)."""
    script = (
        "import sys\n"
        "sys.modules['ray'] = None\n"
        "from rollout_lifecycle.cli import main\n"
        "code = main(['diagram'])\n"
        "print('exit', code)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert "stateDiagram" in done.stdout and done.stdout.strip().endswith("exit 0")


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


def test_ray_and_httpx_are_named_only_in_backends_and_above() -> None:
    for name, path in modules().items():
        if layer_of(name) not in ("core", "contract"):
            continue
        named = {
            (n.module or "").split(".")[0]
            if isinstance(n, ast.ImportFrom)
            else a.name.split(".")[0]
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Import | ast.ImportFrom)
            for a in (n.names if isinstance(n, ast.Import) else [n])  # type: ignore[list-item]
        }
        assert not named & {"ray", "httpx"}, f"{name} imports {named & {'ray', 'httpx'}}"


def test_modules_and_classes_stay_readable() -> None:
    for path in modules().values():
        rel = str(path.relative_to(PACKAGE))
        lines = path.read_text().count("\n")
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
