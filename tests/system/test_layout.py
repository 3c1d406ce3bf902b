"""The package's shape: layers that import only downwards, no import circle (counting the imports
made for type checking and inside functions), a core and an in-process simulator that load
without Ray, no module reaching into another's private names, the engine record the only
writer of an engine's facts, benchmarks on public names only. Sizes follow concerns: no line
count is checked."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rollout_lifecycle"
PUBLIC = {
    "rollout_lifecycle",
    "rollout_lifecycle.testing",
    "rollout_lifecycle.sync",
    "rollout_lifecycle.trainer",
}
#: Each layer may import the layers below it, never one beside or above it: the contract at the
#: bottom; the lifecycle core, the engine backends and the trainer-side fingerprints
#: (``trainer``) side by side over it (none knows another: backends register their seams); the
#: simulators and stand-ins (``testing``), the blocking facade (``sync``), the Prometheus
#: exporter (``metrics``) and the cluster's claims and journal (``lease``) over those; the
#: command line at the top. The package's own ``__init__`` loads what it exports (the backends
#: lazily).
LAYERS = {
    "contract": 0,
    "core": 1,
    "backends": 1,
    "trainer": 1,
    "testing": 2,
    "sync": 2,
    "metrics": 2,
    "lease": 2,
    "cli": 3,
}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports anywhere: at module level, under
    ``TYPE_CHECKING``, inside functions (a type-level or a deferred import ties modules
    together as much as any)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in known}


def python(script: str, *, ok: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter at the repository's root; with ``ok``, it must exit
    0 (its stderr is the failure's message)."""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    if ok:
        assert done.returncode == 0, done.stderr
    return done


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "rollout_lifecycle" else None


def test_every_module_belongs_to_a_layer() -> None:
    for name in modules():
        if name != "rollout_lifecycle":
            assert layer_of(name) in LAYERS, f"{name} is in no layer of {sorted(LAYERS)}"


def test_layers_import_only_downwards_even_through_other_modules() -> None:
    found = modules()
    direct = {name: imports(path, set(found)) for name, path in found.items()}
    for name in found:
        own = layer_of(name)
        if own is None:
            continue
        # Everything ``name`` reaches, through any chain of imports, stays below it.
        seen: dict[str, list[str]] = {name: [name]}
        stack = [name]
        while stack:
            here = stack.pop()
            for target in sorted(direct.get(here, set())):
                if target in seen or layer_of(target) is None:
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
    done = python(script)
    assert done.stdout.strip() == "0 []", done.stdout
    # The blocking really blocks: a backend that needs Ray does not load.
    blocked = python(
        "import sys; sys.modules['ray'] = None\nimport rollout_lifecycle.backends.actor", ok=False
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
    done = python(script)
    assert "stateDiagram" in done.stdout and done.stdout.strip().endswith("exit 0")


def test_no_import_circles() -> None:
    found = modules()
    known = set(found)
    graph = {name: imports(path, known) - {name} for name, path in found.items()}
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


def test_no_module_imports_another_modules_private_names() -> None:
    """What two modules share is public in the one that owns it."""
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "rollout_lifecycle"
            ):
                found += [
                    f"{name} imports {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert not found, found


def test_the_simulator_and_the_checks_load_without_ray() -> None:
    """A user's unit test drives ``SimulatedEngine`` in process with the lifecycle checks and
    needs no Ray; the names of ``testing`` that do need it load it when first used."""
    script = (
        "import sys\n"
        "sys.modules['ray'] = None\n"
        "from rollout_lifecycle import RolloutServer, EngineGroup\n"
        "from rollout_lifecycle.testing import (SimulatedEngine, StandInServer, check_history,\n"
        "    cycle_order_violations, until)\n"
        "try:\n"
        "    from rollout_lifecycle.testing import start_engine_actor\n"
        "except ImportError as exc:\n"
        "    print('actor needs ray:', isinstance(exc, ImportError))\n"
        "print(sorted(m for m in sys.modules if m.startswith('ray.')))\n"
    )
    done = python(script)
    assert done.stdout.splitlines() == ["actor needs ray: True", "[]"], done.stdout


def test_benchmarks_and_examples_import_public_names_only() -> None:
    for folder in ("benchmarks", "examples"):
        for path in sorted((ROOT / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "rollout_lifecycle"
                ):
                    assert node.module in PUBLIC, f"{path.name} imports {node.module}"


#: Mutating methods of the sets an engine record holds (``released``, ``uncertain``).
_MUTATORS = {"add", "clear", "difference_update", "discard", "pop", "remove", "update"}


def test_only_the_engine_record_writes_an_engine_fact() -> None:
    """Every change to what the server knows of an engine is a method of ``EngineRecord``
    (``core/ledger``): no other module assigns, deletes or mutates a field of it. The simulators
    and stand-ins (``testing``) keep engine state of their own under the same names, and a
    launched engine of the demo has a ``handle`` too: they are left out."""
    from dataclasses import fields

    from rollout_lifecycle.core.ledger import EngineRecord

    facts = {f.name for f in fields(EngineRecord)} - {"handle"}
    assert {"paused", "released", "stale", "incarnation", "in_flight"} <= facts
    found = []
    for name, path in modules().items():
        if name == "rollout_lifecycle.core.ledger" or layer_of(name) == "testing":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            written: list[ast.expr] = []
            if isinstance(node, ast.Assign | ast.Delete):
                written = list(node.targets)
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                written = [node.target]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _MUTATORS
            ):
                written = [node.func.value]
            for target in written:
                for part in ast.walk(target) if not isinstance(target, ast.Subscript) else []:
                    if (
                        isinstance(part, ast.Attribute)
                        and part.attr in facts
                        and not (isinstance(part.value, ast.Name) and part.value.id == "self")
                    ):
                        found.append(f"{name}:{node.lineno}: {ast.unparse(part)}")
    assert not found, "engine facts written outside EngineRecord: " + "; ".join(found)
