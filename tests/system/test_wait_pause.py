"""The wait pause mode (``PauseMode.WAIT``): every request in flight runs to its end before the
pause answers. vLLM does it itself (``/pause?mode=wait``); the SGLang client drains with a flush
that waits for idleness, then pauses in retract mode. Shown on stand-in servers, one engine of
each kind, through the clients and through a ``RolloutServer`` over a mixed fleet."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from wire.conftest import vllm_standin

from rollout_lifecycle import (
    Deadlines,
    EngineGroup,
    EngineRejected,
    LifecycleConfig,
    PauseMode,
    PhaseFailed,
    RolloutServer,
    ServerState,
    VLLMHTTPEngine,
)
from rollout_lifecycle.backends.sglang.client import HTTPTimeouts, SGLangHTTPEngine
from rollout_lifecycle.testing import until
from rollout_lifecycle.testing.fleets import READS
from rollout_lifecycle.testing.standin import StandInServer, VLLMStandInServer

#: Seconds per token on the SGLang stand-in, and the tokens of a request that is seen running.
TOKEN_LATENCY = 0.005
TOKENS = 200
KINDS = ("sglang", "vllm")
LIFECYCLE = ("flush_cache", "pause_generation", "release_memory_occupation")


@pytest.fixture
def sglang() -> Iterator[StandInServer]:
    server = StandInServer(token_latency=TOKEN_LATENCY).start()
    yield server
    server.stop()


@pytest.fixture
def vllm() -> Iterator[VLLMStandInServer]:
    server = vllm_standin()
    yield server
    server.stop()


def request(i: int, tokens: int = TOKENS) -> dict[str, Any]:
    return {"input_ids": [3, 5, i], "sampling_params": {"max_new_tokens": tokens}}


def running(server: StandInServer) -> int:
    return server.stats()["running"]


def ops(server: StandInServer | VLLMStandInServer) -> list[tuple[str, Any]]:
    """The lifecycle calls the server has seen, in order, each with its mode or timeout."""
    return [(e["op"], e.get("mode") or e.get("timeout")) for e in server.history()]


async def started(
    client: httpx.AsyncClient, server: StandInServer, n: int, tokens: int = TOKENS
) -> list[asyncio.Task[httpx.Response]]:
    """``n`` requests sent straight to the server, returned once all of them run."""
    tasks = [
        asyncio.create_task(client.post("/generate", json=request(i, tokens))) for i in range(n)
    ]
    await until(lambda: running(server) == n, what=f"{n} requests to run", deadline=120)
    return tasks


async def test_the_sglang_client_waits_for_idleness_with_a_flush_then_pauses_in_retract_mode(
    sglang: StandInServer,
) -> None:
    engine = SGLangHTTPEngine(sglang.url)
    async with httpx.AsyncClient(base_url=sglang.url, timeout=120) as client:
        tasks = await started(client, sglang, 2)
        await engine.pause_generation(PauseMode.WAIT)
        assert running(sglang) == 0
        for answer in await asyncio.gather(*tasks):
            meta = answer.json()["meta_info"]
            assert meta["finish_reason"]["type"] == "length" and meta["num_retractions"] == 0
        assert (await client.get("/ready")).status_code == 503, "paused"
    await engine.close()
    calls = [c for c in ops(sglang) if c[0] in ("flush_cache", "pause_generation")]
    assert calls == [("flush_cache", HTTPTimeouts().drain), ("pause_generation", "retract")]


async def test_a_sglang_engine_not_idle_within_the_drain_timeout_is_left_unpaused(
    sglang: StandInServer,
) -> None:
    engine = SGLangHTTPEngine(sglang.url, timeouts=HTTPTimeouts(drain=0.2))
    async with httpx.AsyncClient(base_url=sglang.url, timeout=120) as client:
        tasks = await started(client, sglang, 1, tokens=5000)
        with pytest.raises(EngineRejected, match=r"wait mode: requests were still in flight aft"):
            await engine.pause_generation(PauseMode.WAIT)
        assert (await client.get("/ready")).status_code == 200, "nothing was paused"
        await client.post("/abort_request", json={"abort_all": True})
        await asyncio.gather(*tasks)
    await engine.close()
    assert "pause_generation" not in [op for op, _ in ops(sglang)]


async def test_a_mixed_fleet_offloads_in_wait_mode_with_every_request_run_to_its_end(
    sglang: StandInServer, vllm: VLLMStandInServer
) -> None:
    groups = [
        EngineGroup("sglang", [SGLangHTTPEngine(sglang.url)]),
        EngineGroup("vllm", [VLLMHTTPEngine(vllm.url)]),
    ]
    server = RolloutServer(groups, LifecycleConfig(pause_mode=PauseMode.WAIT))
    answers = [
        asyncio.ensure_future(server.generate(request(i), group=group))
        for group in KINDS
        for i in range(3)
    ]
    await until(
        lambda: running(sglang) == 3 and running(vllm) == 3,
        what="three requests to run on each engine",
        deadline=120,
    )
    await server.offload()
    assert server.state is ServerState.RELEASED
    for answer in await asyncio.wait_for(asyncio.gather(*answers), 120):
        meta = answer["meta_info"]
        assert len(answer["output_ids"]) == TOKENS, meta
        assert meta["finish_reason"]["type"] == "length", meta
        assert meta["num_resubmissions"] == 0 and meta["num_retractions"] == 0, meta
    # Nothing was running when either engine paused: no request was ever retracted.
    assert sglang.stats()["retractions"] == 0 and vllm.stats()["retractions"] == 0
    assert [c for c in ops(sglang) if c[0] in LIFECYCLE] == [
        ("flush_cache", HTTPTimeouts().drain),
        ("pause_generation", "retract"),
        ("flush_cache", 0.0),
        ("release_memory_occupation", None),
    ]
    await server.onload_weights()
    await server.onload_kv()
    late = await asyncio.gather(*(server.generate(request(9, 4), group=g) for g in KINDS))
    assert [len(a["output_ids"]) for a in late] == [4, 4]


async def test_pauses_that_must_not_wait_on_traffic_are_retract_pauses_in_wait_mode(
    sglang: StandInServer,
) -> None:
    # A group serving others around a weight write might never go idle: it gets a retract
    # pause. An engine whose pause is unknown may be paused already, where a drain would time
    # out: recover() waits for the pause to land, and drains nothing.
    keeper = StandInServer(token_latency=TOKEN_LATENCY).start()
    try:
        groups = [
            EngineGroup("actor", [SGLangHTTPEngine(sglang.url)]),
            EngineGroup("reward", [SGLangHTTPEngine(keeper.url)], needs_offload=False),
        ]
        config = LifecycleConfig(pause_mode=PauseMode.WAIT, deadlines=Deadlines(pause=1.0))
        server = RolloutServer(groups, config)
        await server.offload()
        await server.onload_weights()
        await server.update_weights(lambda update: None)
        paused = [c for c in ops(keeper) if c[0] in LIFECYCLE]
        assert paused == [("pause_generation", "retract"), ("flush_cache", 0.0)]
        await server.onload_kv()
        # The actor's next pause outlives its deadline: its outcome is unknown.
        sglang.inject({"path": "/pause_generation", "kind": "delay", "seconds": 3})
        with pytest.raises(PhaseFailed, match="actor/0: timed_out"):
            await server.offload()
        assert server.state is ServerState.FAILED
        before = len(ops(sglang))
        assert await server.recover(lambda engine_id: None) == {}
        # It waits for the late pause to land and continues the engine; no drain is sent.
        assert server.state is ServerState.SERVING
        assert ("flush_cache", HTTPTimeouts().drain) not in ops(sglang)[before:]
        assert [c for c in ops(sglang) if c[0] not in READS][-1] == ("continue_generation", None)
    finally:
        keeper.stop()
