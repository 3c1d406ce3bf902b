"""``rollout-lifecycle ctl`` against real SGLang 0.5.23 servers with requests decoding: an
offload and an onload from a shell, run as the installed command, lose nothing."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from real.servers import RealServer

from rollout_lifecycle import EngineGroup, LifecycleEvent, RolloutServer, SGLangHTTPEngine
from rollout_lifecycle.testing.sse import sse_events

pytestmark = pytest.mark.real_sglang

#: The project's own command, next to the interpreter running the tests.
CLI = str(Path(sys.executable).with_name("rollout-lifecycle"))
ALL_TAGS = ["weights", "kv_cache", "cuda_graph"]
PER_SERVER = 2
NEW_TOKENS = 256


class StreamedRequest:
    """One ``/generate`` request streamed on its own thread; ``started`` is set at its first
    chunk (it is decoding), ``final`` holds its last chunk once it ends."""

    def __init__(self, url: str, index: int) -> None:
        self.url = url
        self.index = index
        self.started = threading.Event()
        self.final: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {
            "input_ids": [11, 7 + self.index],
            "stream": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        }
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0), trust_env=False) as client,
                client.stream("POST", f"{self.url}/generate", json=body) as answer,
            ):
                answer.raise_for_status()
                for event in sse_events(answer.iter_bytes()):
                    self.final = event
                    self.started.set()
        except BaseException as exc:  # reported by the test, with the request it broke
            self.error = exc
        finally:
            self.started.set()


@pytest.fixture
def traffic(real_servers: list[RealServer]) -> Iterator[list[StreamedRequest]]:
    requests = [StreamedRequest(s.url, i) for s in real_servers for i in range(PER_SERVER)]
    for request in requests:
        request.thread.start()
    yield requests
    for request in requests:
        request.thread.join(timeout=600)


def ctl(action: str, servers: list[RealServer], state: Path) -> tuple[int, dict[str, Any]]:
    engines = [a for s in servers for a in ("--engine", s.url)]
    done = subprocess.run(
        [CLI, "ctl", action, *engines, "--state-file", str(state), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "XDG_STATE_HOME": str(state.parent / "xdg")},
    )
    assert done.stdout, f"ctl {action} printed nothing; stderr:\n{done.stderr}"
    report: dict[str, Any] = json.loads(done.stdout)
    assert report["exit_code"] == done.returncode, done.stderr
    return done.returncode, report


def ledger(state: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(state.read_text())
    return data


def test_ctl_offloads_and_onloads_real_servers_with_requests_decoding_and_loses_none(
    real_servers: list[RealServer], traffic: list[StreamedRequest], tmp_path: Path
) -> None:
    state = tmp_path / "fleet.json"
    urls = [s.url for s in real_servers]
    for request in traffic:
        assert request.started.wait(300), f"request {request.index} never started decoding"
        assert request.error is None, request.error

    code, report = ctl("offload", real_servers, state)
    assert code == 0, report["error"]
    assert (report["previous_state"], report["state"]) == ("serving", "released")
    assert report["ledger_found"] is False and report["ledger_written"] is True
    recorded = ledger(state)
    assert recorded["engines"] == urls
    assert recorded["server"]["state"] == "released"
    assert recorded["last_call"]["action"] == "offload" and recorded["last_call"]["exit_code"] == 0
    for engine in report["engines"]:
        assert engine["paused"] and engine["released"] == ALL_TAGS and engine["alive"]

    code, status = ctl("status", real_servers, state)
    assert code == 0 and status["recorded_state"] == "released"
    for row in status["engines"]:
        # Paused: /ready answers 503, which agrees with the ledger.
        assert row["reachable"] and row["ready_status"] == 503 and row["agrees"] is True

    code, report = ctl("onload-weights", real_servers, state)
    assert code == 0, report["error"]
    assert report["state"] == "weights_restored"
    assert ledger(state)["server"]["state"] == "weights_restored"
    assert all(e["released"] == ["kv_cache", "cuda_graph"] for e in report["engines"])

    code, report = ctl("onload-kv", real_servers, state)
    assert code == 0, report["error"]
    assert report["state"] == "serving"
    assert all(not e["paused"] and e["released"] == [] for e in report["engines"])
    recorded = ledger(state)
    assert recorded["server"]["state"] == "serving"
    assert recorded["last_call"] == {**recorded["last_call"], "action": "onload-kv", "error": None}

    for request in traffic:
        request.thread.join(timeout=600)
        assert request.error is None, f"request {request.index}: {request.error!r}"
        assert request.final is not None
        meta = request.final["meta_info"]
        assert meta["finish_reason"]["type"] == "length", meta
        assert meta["completion_tokens"] == NEW_TOKENS
        assert len(request.final["output_ids"]) == NEW_TOKENS
    for server in real_servers:
        assert server.alive(), server.output()
        assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200


async def test_ctl_beside_a_training_process_on_real_servers_is_refused_and_kills_nothing(
    real_servers: list[RealServer], tmp_path: Path
) -> None:
    """A training process's call holds the engines' claims; a ctl run (its own state file)
    is refused at once, naming it, with nothing sent; then the process carries on."""
    engines = [SGLangHTTPEngine(s.url) for s in real_servers]
    trainer = RolloutServer([EngineGroup("actor", engines)], name="trainer")
    holding, go_on = asyncio.Event(), asyncio.Event()

    async def hold(event: LifecycleEvent) -> None:
        holding.set()
        await go_on.wait()

    trainer.on("before_pause", hold)
    call = asyncio.ensure_future(trainer.offload())
    try:
        await asyncio.wait_for(holding.wait(), 300)  # the trainer's call holds the claims
        code, report = await asyncio.to_thread(ctl, "offload", real_servers, tmp_path / "c.json")
        assert code == 7, report
        message = report["error"]["message"]
        assert f"pid {os.getpid()}" in message and "server 'trainer'" in message
        assert await ready_statuses(real_servers) == [200] * len(real_servers)  # nothing sent
    finally:
        go_on.set()
        await asyncio.wait_for(call, 600)
    assert trainer.state.value == "released"
    await trainer.onload()
    assert all(server.alive() for server in real_servers)
    assert await ready_statuses(real_servers) == [200] * len(real_servers)
    await asyncio.gather(*(e.close() for e in engines))


async def ready_statuses(servers: list[RealServer]) -> list[int]:
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        return [(await client.get(f"{s.url}/ready")).status_code for s in servers]
