"""``rollout-lifecycle ctl --engine-kind vllm`` against a real vLLM 0.32.0 server, run as the
installed command: each action prints what it did, and the server really is paused, asleep and
awake again between them, as its own ``/is_paused`` and ``/metrics`` say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from real.servers import RealVLLMServer

from rollout_lifecycle.backends.vllm.client import parse_sleep_state

pytestmark = pytest.mark.real_vllm

#: The project's own command, next to the interpreter running the tests.
CLI = str(Path(sys.executable).with_name("rollout-lifecycle"))
ALL_TAGS = ["weights", "kv_cache", "cuda_graph"]


@pytest.fixture(autouse=True)
async def left_serving(vllm_servers: list[RealVLLMServer]) -> AsyncIterator[None]:
    """The server is left awake and resumed, also when the test failed half-way."""
    yield
    async with httpx.AsyncClient(base_url=vllm_servers[1].url, timeout=60) as raw:
        if parse_sleep_state((await raw.get("/metrics")).text) != "awake":
            await raw.post("/wake_up")
        await raw.post("/resume")


def ctl(action: str, url: str, state: Path, *extra: str) -> tuple[int, str]:
    command = [CLI, "ctl", action, "--engine-kind", "vllm", "--engine", url]
    done = subprocess.run(
        [*command, "--state-file", str(state), *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "XDG_STATE_HOME": str(state.parent / "xdg")},
    )
    assert done.stdout, f"ctl {action} printed nothing; stderr:\n{done.stderr}"
    return done.returncode, done.stdout


def ctl_json(action: str, url: str, state: Path) -> dict[str, Any]:
    code, out = ctl(action, url, state, "--json")
    report: dict[str, Any] = json.loads(out)
    assert code == report["exit_code"] == 0, report["error"]
    return report


def observed(url: str) -> tuple[bool, str | None]:
    """What the server says: ``/is_paused``, and its sleep state in ``/metrics``."""
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as raw:
        # vllm: entrypoints/rl/online/api_router.py is_paused
        paused: bool = raw.get("/is_paused").json()["is_paused"]
        # vllm: v1/metrics/loggers.py record_sleep_state (vllm:engine_sleep_state)
        return paused, parse_sleep_state(raw.get("/metrics").text)


def test_ctl_pauses_offloads_onloads_and_continues_a_real_vllm_server(
    vllm_servers: list[RealVLLMServer], tmp_path: Path
) -> None:
    url = vllm_servers[1].url
    state = tmp_path / "fleet.json"
    status = ctl_json("status", url, state)
    (row,) = status["engines"]
    assert status["engine_kind"] == "vllm" and status["recorded_state"] is None
    assert (row["id"], row["health_status"], row["ready"]) == ("vllm/0", 200, True)
    assert (row["paused"], row["sleep_state"]) == (False, "awake")
    assert observed(url) == (False, "awake")

    report = ctl_json("pause", url, state)
    assert (report["previous_state"], report["state"]) == ("serving", "drained")
    assert report["engines"][0]["paused"] and report["engines"][0]["released"] == []
    assert observed(url) == (True, "awake")

    report = ctl_json("offload", url, state)  # drained -> released: the release alone
    assert (report["previous_state"], report["state"]) == ("drained", "released")
    assert report["engines"][0]["released"] == ALL_TAGS
    assert observed(url) == (True, "weights_offloaded")  # /sleep?level=1
    assert json.loads(state.read_text())["engine_kind"] == "vllm"

    status = ctl_json("status", url, state)
    (row,) = status["engines"]
    assert status["recorded_state"] == "released"
    assert (row["health_status"], row["ready"], row["paused"]) == (200, False, True)
    assert row["sleep_state"] == "weights_offloaded" and row["agrees"] is True

    report = ctl_json("onload-weights", url, state)
    assert report["state"] == "weights_restored"
    assert report["engines"][0]["released"] == ["kv_cache", "cuda_graph"]
    # Not fully awake: still paused, and vLLM leaves the gauge as the sleep set it.
    assert observed(url) == (True, "weights_offloaded")

    report = ctl_json("onload-kv", url, state)  # the KV cache's wake, then the continue
    assert (report["state"], report["engines"][0]["paused"]) == ("serving", False)
    assert observed(url) == (False, "awake")

    code, out = ctl("resume", url, state)  # already serving: it says so and sends nothing
    assert code == 0 and out.splitlines()[0] == "resume: serving -> serving (ok)"

    code, out = ctl("status", url, state)
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("recorded state: serving (last call resume exit 0")
    header = next(line for line in lines if line.startswith("ENGINE"))
    row_line = next(line for line in lines if line.startswith("vllm/0"))
    assert row_line[header.index("READY (HEALTH)") :].startswith("yes (200)")
    assert row_line[header.index("SLEEP") :].startswith("awake")
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as raw:
        answer = raw.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"]
