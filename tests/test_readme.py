"""The README cannot rot: its code runs, its diagram matches the machine, its commands are first."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import ray

from rollout_lifecycle import RolloutServer, mermaid

README = Path(__file__).resolve().parent.parent / "README.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", README.read_text(), flags=re.S | re.M)


def test_readme_opens_with_the_demo_and_the_test_commands() -> None:
    commands = blocks("bash")
    assert commands[0].strip() == "pip install . && rollout-lifecycle demo"
    assert commands[1].strip().endswith("python -m pytest")
    first_code = README.read_text().index("```")
    assert README.read_text().index("```bash", first_code) == first_code


def test_readme_diagram_is_the_one_the_machine_runs_on() -> None:
    (diagram,) = blocks("mermaid")
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
