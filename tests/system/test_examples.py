"""Every script in examples/ runs to its summary line and leaves no thread or actor behind.

The scripts run in-process on the session's Ray cluster (a Ray start costs seconds); one runs
as its own process, starting and stopping Ray itself, as a user would run it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
import ray

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SUMMARIES = {
    "colocated_loop": "colocated_loop: 3 steps on 2 engines, 48/48 requests completed",
    "context_manager": "context_manager: 2 offloaded() steps (1 raised), 2 weight pushes",
    "multi_stage_wake": "multi_stage_wake: peak memory 74.0 -> 58.0 GiB (-21.6%)",
    "weight_sync": "weight_sync: 3 syncs under paused(), 18 requests completed",
}


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def alive_actors() -> set[str]:
    # The state API needs the dashboard, which the test cluster runs without; the GCS table
    # answers directly.
    from ray._private import state

    return {k for k, v in state.actors().items() if v["State"] != "DEAD"}


def test_every_example_is_covered() -> None:
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == sorted(SUMMARIES)


@pytest.mark.parametrize("name", sorted(SUMMARIES))
def test_example_runs_and_leaves_nothing_behind(
    name: str, ray_cluster: None, capsys: pytest.CaptureFixture[str]
) -> None:
    module = load(name)
    threads = set(threading.enumerate())
    actors = alive_actors()
    assert module.main() == 0
    assert SUMMARIES[name] in capsys.readouterr().out
    assert ray.is_initialized()  # it did not shut down the cluster it did not start
    assert set(threading.enumerate()) <= threads
    deadline = time.monotonic() + 10
    while alive_actors() - actors and time.monotonic() < deadline:
        time.sleep(0.1)  # ray.kill is asynchronous
    assert not alive_actors() - actors


def test_the_colocated_loop_runs_as_a_script() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "colocated_loop.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert SUMMARIES["colocated_loop"] in done.stdout
