"""RolloutServer -> Ray engine actors -> HTTP -> stand-in SGLang servers on loopback."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray
from backends.test_http_faults import passthrough
from structlog.testing import capture_logs
from system.router_traffic import stats

from rollout_lifecycle import (
    Deadlines,
    EngineGroup,
    EngineHost,
    IllegalEngineOp,
    LifecycleConfig,
    Outcome,
    PhaseFailed,
    RolloutServer,
    ServerState,
    Tag,
    WeightUpdate,
    start_engine_actor,
)
from rollout_lifecycle.backends.sglang.client import SGLangHTTPEngine, sglang_http_factory
from rollout_lifecycle.core.runner import PhaseSettled
from rollout_lifecycle.testing import cycle_order_violations
from rollout_lifecycle.testing.standin import StandInServer

ADMIN_KEY = "adm-3f9c2e7b1d"
#: The length of the traffic's requests (see ``test_full_colocated_cycle_over_http...``).
TOKENS = 3000
LATENCY = {
    "pause_generation": (0.0, 0.03),
    "flush_cache": (0.0, 0.03),
    "release_memory_occupation": (0.0, 0.05),
    "resume_memory_occupation": (0.0, 0.05),
    "continue_generation": (0.0, 0.02),
}


@pytest.fixture(scope="module")
def servers() -> Iterator[list[StandInServer]]:
    with StandInServer.running(4, admin_key=ADMIN_KEY, token_latency=0.004, seed=5) as servers:
        yield servers


async def history_of(url: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await client.get(f"{url}/_standin/history")
        answer.raise_for_status()
        result: list[dict[str, Any]] = answer.json()
        return result


async def until_running(servers: list[StandInServer], count: int) -> None:
    """Wait (bounded) until every server's scheduler runs ``count`` requests."""
    for _ in range(600):
        running = [(await stats(s.url))["running"] for s in servers]
        if all(n >= count for n in running):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"requests never all ran: {running}")


async def generate(client: httpx.AsyncClient, url: str, i: int, tokens: int) -> dict[str, Any]:
    answer = await client.post(
        f"{url}/generate",
        json={"input_ids": [i, 7], "sampling_params": {"max_new_tokens": tokens}},
    )
    answer.raise_for_status()
    result: dict[str, Any] = answer.json()
    return result


async def test_full_colocated_cycle_over_http_with_traffic_in_flight(
    ray_cluster: None, servers: list[StandInServer]
) -> None:
    actors = [start_engine_actor(sglang_http_factory(s.url, admin_key=ADMIN_KEY)) for s in servers]
    try:
        await asyncio.wait_for(asyncio.gather(*(a.ping.remote() for a in actors)), timeout=60)
        # The probe below warms each actor's way to its server; on a machine under two CPU hogs
        # an actor's first reads took longer than the default probe deadline (10 s), which is
        # the machine's speed, not what this test shows: a deadline load cannot reach.
        server = RolloutServer(
            [EngineGroup("actor", actors[:2]), EngineGroup("critic", actors[2:])],
            LifecycleConfig(deadlines=Deadlines(probe=120.0)),
        )
        # Every engine actor's way to its server is warm (its first reads and connection) before
        # traffic starts, so the pause below follows the fact it waits for closely.
        probed = await server.probe()
        assert all(o.ok for o in probed.values()), probed
        before = {s.url: len(await history_of(s.url)) for s in servers}
        async with httpx.AsyncClient(timeout=180) as client:
            # Long enough (12 s at 4 ms a token) to be decoding still when the pause lands, on a
            # loaded machine too: a retract pause retracts only what runs.
            traffic = [
                asyncio.ensure_future(generate(client, servers[i % 4].url, i, TOKENS))
                for i in range(24)
            ]
            # A fact, not a sleep: every server's scheduler runs its six requests.
            await until_running(servers, 6)
            await server.offload()
            assert server.state is ServerState.RELEASED
            await server.onload_weights()

            async def push(update: WeightUpdate) -> None:
                await asyncio.gather(
                    *(
                        h.update_weights_from_disk.remote("/ckpt/step-1", update.version)
                        for h in update.engines.values()
                    )
                )

            await server.update_weights(push, version="step-1")
            await server.onload_kv()
            results = await asyncio.wait_for(asyncio.gather(*traffic), timeout=180)
        assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["length"] * 24
        assert sum(r["meta_info"]["num_retractions"] for r in results) > 0
        histories = {s.url: (await history_of(s.url))[before[s.url] :] for s in servers}
        assert cycle_order_violations(histories) == []
        for history in histories.values():
            ops = [e["op"] for e in history]
            assert ops.count("release_memory_occupation") == 1
            assert "health" not in ops and "health_generate" not in ops
        versions = await asyncio.gather(*(a.weight_version.remote() for a in actors))
        assert versions == ["step-1"] * 4
    finally:
        for actor in actors:
            ray.kill(actor)


async def test_auth_missing_or_wrong_key_is_refused_with_401_and_the_key_never_logged(
    servers: list[StandInServer], caplog: pytest.LogCaptureFixture
) -> None:
    url = servers[0].url
    for key in (None, "wrong-key"):
        engine = SGLangHTTPEngine(url, admin_key=key)
        server = RolloutServer([EngineGroup("actor", [engine])])
        with pytest.raises(PhaseFailed) as err:
            await server.offload()
        outcome = err.value.outcomes["actor/0"]
        assert outcome.outcome is Outcome.REJECTED and "401" in outcome.detail
        await engine.close()
    caplog.set_level(logging.DEBUG)
    engine = SGLangHTTPEngine(url, admin_key=ADMIN_KEY)
    server = RolloutServer([EngineGroup("actor", [engine])])
    with capture_logs() as events:
        await server.offload()
        await server.onload()
    await engine.close()
    assert server.state is ServerState.SERVING
    assert events, "the cycle emitted no events"
    everything = repr(events) + caplog.text + repr(engine) + repr(server.snapshot())
    assert ADMIN_KEY not in everything


async def test_guard_refuses_fatal_misuse_over_http_and_the_servers_live(
    servers: list[StandInServer],
) -> None:
    engines = [SGLangHTTPEngine(s.url, admin_key=ADMIN_KEY) for s in servers[:2]]
    group = EngineGroup("actor", engines)
    server = RolloutServer([group])
    await server.offload()
    with pytest.raises(IllegalEngineOp, match="already released"):
        group.release_memory([Tag.KV_CACHE])
    await server.onload_weights()
    with pytest.raises(IllegalEngineOp, match="released"):
        group.continue_generation()
    with pytest.raises(IllegalEngineOp, match="not released"):
        group.resume_memory([Tag.WEIGHTS])
    await server.onload_kv()
    assert all(not s.state()["paused"] for s in servers[:2])
    assert all(s.alive() for s in servers[:2])
    await asyncio.gather(*(e.close() for e in engines))


class _HeldPauses(httpx.AsyncBaseTransport):
    """The link to a slow server: its pause is held on the way until ``go`` is set, so it is
    answered as late as the test says, however fast or loaded the machine. Other calls go
    through at once."""

    def __init__(self) -> None:
        self._inner = passthrough()
        self.go = asyncio.Event()
        self.held = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/pause_generation":
            self.held += 1
            await self.go.wait()
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


async def test_slow_server_fails_the_phase_by_its_deadline_and_is_named() -> None:
    slow = StandInServer(admin_key=ADMIN_KEY)
    fast = StandInServer(admin_key=ADMIN_KEY)
    StandInServer.start_all([slow, fast])
    late = _HeldPauses()
    try:
        engines = [
            SGLangHTTPEngine(fast.url, admin_key=ADMIN_KEY),
            SGLangHTTPEngine(slow.url, admin_key=ADMIN_KEY, transport=late),
        ]
        # A deadline the fast server meets on a loaded machine too (it answers in
        # milliseconds; at 0.5 s it was named with the slow one under load). The slow one's
        # pause is held until the pause phase has settled, so it cannot answer in time; then it
        # lands, and the continue after the failed drain, which waits for a late pause, follows.
        server = RolloutServer(
            [EngineGroup("actor", engines)],
            LifecycleConfig(deadlines=Deadlines(pause=5.0)),
        )
        # Per settled pause phase: each engine's outcome, and whether the pause was held then.
        settled: list[tuple[dict[str, Outcome], bool]] = []

        def on_settled(event: PhaseSettled) -> None:
            if event.result.phase == "pause":
                outcomes = {k: o.outcome for k, o in event.result.outcomes.items()}
                settled.append((outcomes, late.held == 1 and not late.go.is_set()))
                late.go.set()

        server.bus.subscribe(PhaseSettled, on_settled)
        with pytest.raises(PhaseFailed) as err:
            await asyncio.wait_for(server.offload(), timeout=60)
        # The phase settled on its deadline, with the slow server's pause still held.
        assert settled == [({"actor/0": Outcome.OK, "actor/1": Outcome.TIMED_OUT}, True)]
        assert late.held == 1
        assert err.value.failed_engines == ["actor/1"]
        assert err.value.outcomes["actor/1"].outcome is Outcome.TIMED_OUT
        assert server.state is ServerState.FAILED
        snap = server.snapshot().engines()
        assert snap["actor/0"].released == () and not snap["actor/0"].paused
        await asyncio.gather(*(e.close() for e in engines))
    finally:
        slow.stop()
        fast.stop()


async def test_unreachable_server_fails_the_phase_without_hanging() -> None:
    with StandInServer() as gone:
        url = gone.url
    engine = SGLangHTTPEngine(url, retries=1)
    host = EngineHost(engine)
    server = RolloutServer([EngineGroup("actor", [host])])
    with pytest.raises(PhaseFailed) as err:
        await asyncio.wait_for(server.offload(), timeout=10)
    assert err.value.outcomes["actor/0"].outcome is Outcome.DEAD
    assert not server.snapshot().engines()["actor/0"].alive
    await engine.close()
