"""The test-only start-up hooks of real servers (``tests/real/shim/sitecustomize.py``): the fork
switch turns SGLang's request for spawned children into fork, and only when it is set; the
tier's own servers run with it, and their processes show it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from real.servers import FORK_ENV, SHIM_DIR, RealServer, running_in_group

#: What SGLang does before it starts its children (sglang 0.5.23 ``_set_envs_and_config``).
ASK_FOR_SPAWN = (
    "import multiprocessing as mp; mp.set_start_method('spawn', force=True); "
    "print(mp.get_start_method())"
)


def start_method_with(env: dict[str, str]) -> str:
    """The start method a process with the shim on its path ends with after asking for spawn."""
    base = {k: v for k, v in os.environ.items() if k != FORK_ENV}
    done = subprocess.run(
        [sys.executable, "-c", ASK_FOR_SPAWN],
        env={**base, "PYTHONPATH": str(SHIM_DIR), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.strip()


def test_the_fork_switch_turns_a_request_for_spawn_into_fork_only_when_set() -> None:
    assert start_method_with({FORK_ENV: "1"}) == "fork"
    assert start_method_with({}) == "spawn"
    assert start_method_with({FORK_ENV: "0"}) == "spawn"


def command_lines(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.mark.real_sglang
def test_the_tiers_servers_fork_their_children(real_servers: list[RealServer]) -> None:
    """A spawned child comes with multiprocessing's resource tracker (a process of its own in
    the server's group, started by spawn's ``Popen._launch`` in CPython's
    multiprocessing/popen_spawn_posix.py); a forked one does not."""
    for server in real_servers:
        assert server.proc is not None
        server.process_titled("sglang::scheduler")  # (raises when there is none)
        lines = [command_lines(pid) for pid in running_in_group(server.proc.pid)]
        assert not any("resource_tracker" in line for line in lines), lines
