"""The README cannot rot: its code runs, its diagram (and docs/design.md's) matches the machine,
its commands are first."""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from real.servers import CPU_FLAGS, SHIM_DIR, VLLM_CPU_FLAGS, RealSGLang, RealVLLM

from rollout_lifecycle import RolloutServer, mermaid
from rollout_lifecycle.testing import StandInServer
from rollout_lifecycle.testing.standin import VLLMStandInServer

README = Path(__file__).resolve().parents[2] / "README.md"
DESIGN = README.parent / "docs" / "design.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def test_readme_opens_with_the_demo_and_the_test_commands() -> None:
    commands = blocks("bash")
    assert commands[0].strip() == "pip install '.[plot]' && rollout-lifecycle demo"
    assert commands[1].strip().endswith("python -m pytest -n 2")
    first_code = README.read_text().index("```")
    assert README.read_text().index("```bash", first_code) == first_code


def test_readme_diagram_is_the_one_the_machine_runs_on() -> None:
    (diagram,) = blocks("mermaid")
    assert diagram == mermaid()


def test_design_doc_diagram_is_the_one_the_machine_runs_on() -> None:
    (diagram,) = re.findall(r"^```mermaid\n(.*?)^```$", DESIGN.read_text(), flags=re.S | re.M)
    assert diagram == mermaid()


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_readme_python_block_runs(
    index: int, ray_cluster: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_ADMIN_KEY", "readme-example-key")
    code = blocks("python")[index]
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    try:
        exec(compile(code, f"README.md python block {index}", "exec"), namespace)
    finally:
        for actor in namespace.get("actors", []):
            ray.kill(actor)
    if "server" in namespace:
        assert isinstance(namespace["server"], RolloutServer)


ADMIN_KEY = "readme-admin-key"


@pytest.fixture(scope="module")
def sglang_standins() -> Iterator[list[StandInServer]]:
    with StandInServer.running(3, admin_key=ADMIN_KEY, token_latency=0.002) as servers:
        yield servers


def command_path(tmp_path: Path) -> str:
    """PATH with ``rollout-lifecycle`` on it: the installed script, or one running this tree."""
    path = os.environ.get("PATH", "")
    if shutil.which("rollout-lifecycle"):
        return path
    shim = tmp_path / "bin" / "rollout-lifecycle"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m rollout_lifecycle.cli "$@"\n')
    shim.chmod(0o755)
    return f"{shim.parent}{os.pathsep}{path}"


@pytest.fixture(scope="module")
def vllm_fleet() -> Iterator[list[VLLMStandInServer]]:
    servers = [VLLMStandInServer(token_latency=0.002).start() for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("index", range(2, len(blocks("bash"))))
def test_readme_shell_block_runs(
    index: int,
    ray_cluster: None,
    sglang_standins: list[StandInServer],
    vllm_fleet: list[VLLMStandInServer],
    tmp_path: Path,
) -> None:
    """Each shell block after the two opening commands runs as written, in a folder with an
    ``engines.txt`` that lists three stand-in SGLang servers and a ``vllm-engines.txt`` that
    lists two stand-in vLLM servers. (``sh`` blocks need real engines: see below.)"""
    (tmp_path / "engines.txt").write_text("".join(f"{s.url}\n" for s in sglang_standins))
    (tmp_path / "vllm-engines.txt").write_text("".join(f"{s.url}\n" for s in vllm_fleet))
    env = {
        **os.environ,
        "PATH": command_path(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(README.parent), os.environ.get("PYTHONPATH", "")]),
        "SGLANG_ADMIN_KEY": ADMIN_KEY,
        "XDG_STATE_HOME": str(tmp_path / "state"),
    }
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", blocks("bash")[index]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert ADMIN_KEY not in done.stdout + done.stderr


def flags_after(language: str, word: str) -> dict[str, list[str]]:
    """The values of each ``--flag`` after ``word`` in the README's one ``language`` block."""
    (block,) = blocks(language)
    words = shlex.split(block.replace("\\\n", " "))
    given: dict[str, list[str]] = {}
    for flag, value in itertools.pairwise(words[words.index(word) :]):
        if flag.startswith("--"):
            given.setdefault(flag, []).append(value)
    return given


def test_readme_real_demo_command_passes_what_the_real_tier_passes() -> None:
    """The README's demo on real servers (an ``sh`` block: it needs both engines' environments)
    gives each kind the arguments and environment the real tiers start their servers with, so
    it runs as the real demo test does."""
    given = flags_after("sh", "rollout-lifecycle")
    assert shlex.split(given["--sglang-args"][0]) == list(CPU_FLAGS)
    assert shlex.split(given["--vllm-args"][0]) == list(VLLM_CPU_FLAGS)
    sglang_env = dict(pair.split("=", 1) for pair in given["--sglang-env"])
    sglang_env["PYTHONPATH"] = sglang_env["PYTHONPATH"].replace("$PWD", str(README.parent))
    assert sglang_env == RealSGLang("python", "model").child_env() | {"PYTHONPATH": str(SHIM_DIR)}
    vllm_env = dict(pair.split("=", 1) for pair in given["--vllm-env"])
    # The launcher sets VLLM_SERVER_DEV_MODE=1 itself.
    assert vllm_env | {"VLLM_SERVER_DEV_MODE": "1"} == RealVLLM("python", "model").child_env()
    assert given["--model"] == ["$c/tiny-gpt2"] and given["--steps"] == ["2"]


def test_readme_rl_loop_command_starts_its_servers_as_the_real_tier_does() -> None:
    """The showcase's command (a ``shell`` block: it needs the SGLang environment) gives the
    servers the arguments and environment the real tier runs ``examples/real/rl_loop.py``
    with."""
    given = flags_after("shell", "examples/real/rl_loop.py")
    assert shlex.split(given["--sglang-args"][0]) == list(CPU_FLAGS)
    sglang_env = dict(pair.split("=", 1) for pair in given["--sglang-env"])
    sglang_env["PYTHONPATH"] = sglang_env["PYTHONPATH"].replace("$PWD", str(README.parent))
    assert sglang_env == RealSGLang("python", "model").child_env() | {"PYTHONPATH": str(SHIM_DIR)}
    assert (README.parent / "examples" / "real" / "rl_loop.py").is_file()
