"""A fleet behind a real sglang-router (0.3.2): the router's worker set follows the engines that
serve through offload cycles, weight updates, engine death and recovery, and bad router input
gets a clear error with the lifecycle state left exact.

Engines are stand-in SGLang servers (subprocesses) driven in process; every test launches its
own router (``LaunchedRouter``) with the router's default health checks on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import ray
from system.router_traffic import Traffic, ids, listed, stats

from rollout_lifecycle import (
    EngineGroup,
    LaunchedRouter,
    LifecycleConfig,
    PauseMode,
    RolloutServer,
    RouterError,
    ServerState,
    SGLangHTTPEngine,
    SGLangRouter,
    free_port,
    sglang_http_factory,
    start_engine_actor,
)
from rollout_lifecycle.testing.standin import StandInServer

S = ServerState
#: A stand-in makes one token per TOKEN_S.
TOKEN_S = 0.004


@pytest.fixture(scope="module")
def standins() -> Iterator[list[StandInServer]]:
    with StandInServer.running(3, token_latency=TOKEN_S, seed=11) as servers:
        yield servers


@contextlib.asynccontextmanager
async def router_for(**options: Any) -> AsyncIterator[LaunchedRouter]:
    launched = LaunchedRouter(**options)
    try:
        yield await launched.wait_ready()
    finally:
        launched.stop()


def engine_groups(urls: list[str], keeper: str | None = None, **config: Any) -> list[EngineGroup]:
    groups = [EngineGroup("actor", [SGLangHTTPEngine(u) for u in urls])]
    if keeper is not None:
        groups.append(EngineGroup("reward", [SGLangHTTPEngine(keeper)], needs_offload=False))
    return groups


async def one_cycle(server: RolloutServer) -> None:
    await server.offload()
    await server.onload_weights()
    await server.onload_kv()


async def test_the_router_lists_exactly_the_engines_that_serve(
    standins: list[StandInServer],
) -> None:
    a, b, keeper = (s.url for s in standins)
    async with router_for() as launched:
        router = launched.client()
        server = RolloutServer(engine_groups([a, b], keeper), router=router)
        assert await listed(router) == set()
        done = await server.sync_router()
        assert ids(*done["added"]) == ids(a, b, keeper) and done["removed"] == []
        assert await listed(router) == ids(a, b, keeper)
        await server.offload()
        assert await listed(router) == ids(keeper)  # the memory-keeping group serves on
        await server.onload_weights()
        assert await listed(router) == ids(keeper)
        during: list[set[str]] = []

        async def push(update: object) -> None:  # the keeper is paused around the write
            during.append(await listed(router))

        await server.update_weights(push)
        assert during == [set()] and await listed(router) == ids(keeper)
        await server.onload_kv()
        assert await listed(router) == ids(a, b, keeper)
        await server.pause()
        assert await listed(router) == set()
        await server.resume()
        assert await listed(router) == ids(a, b, keeper)
        assert await server.sync_router() == {"added": [], "removed": []}
        await router.close()


@pytest.mark.parametrize("mode", [PauseMode.RETRACT, PauseMode.ABORT])
async def test_traffic_through_the_router_loses_nothing_over_20_cycles(
    standins: list[StandInServer], mode: PauseMode
) -> None:
    a, b, _ = (s.url for s in standins)
    async with router_for() as launched:
        router = launched.client()
        server = RolloutServer(
            engine_groups([a, b]), LifecycleConfig(pause_mode=mode), router=router
        )
        await server.sync_router()
        traffic = Traffic(launched.url, senders=4)
        reached_released: list[str] = []
        try:
            async with traffic.running(deadline=60):
                for _ in range(20):
                    await traffic.busy()  # every offload meets traffic on its way
                    await server.offload()
                    before = {u: (await stats(u))["submitted"] for u in (a, b)}
                    await asyncio.sleep(0.05)  # traffic keeps arriving at the router meanwhile
                    after = {u: (await stats(u))["submitted"] for u in (a, b)}
                    reached_released += [u for u in (a, b) if after[u] != before[u]]
                    await server.onload_weights()
                    await server.onload_kv()
                    assert server.state is S.SERVING
        finally:
            await router.close()
        assert traffic.lost == [] and traffic.completed == traffic.sent
        assert reached_released == [], "requests reached workers with their memory released"
        print(
            f"[{mode.value}] 20 cycles over stand-ins: sent={traffic.sent} "
            f"completed={traffic.completed} refused_and_retried={traffic.retried} "
            f"aborted_and_resubmitted={traffic.resubmitted} lost={len(traffic.lost)}"
        )


@pytest.mark.parametrize("death", ["process exits", "ray.kill"])
async def test_recover_swaps_a_dead_worker_for_its_replacement_once_it_has_weights(
    ray_cluster: None, standins: list[StandInServer], death: str
) -> None:
    doomed = StandInServer(token_latency=TOKEN_S).start()
    a = standins[0].url
    made: list[StandInServer] = []
    actors: list[Any] = []

    def engine(url: str) -> Any:
        if death == "process exits":  # in process: the engine dies with its server
            return SGLangHTTPEngine(url)
        actors.append(start_engine_actor(sglang_http_factory(url)))  # its server outlives it
        return actors[-1]

    def factory(engine_id: str) -> Any:
        made.append(StandInServer(token_latency=TOKEN_S).start())
        return engine(made[-1].url)

    try:
        async with router_for() as launched:
            router = launched.client()
            groups = [EngineGroup("actor", [engine(a), engine(doomed.url)])]
            server = RolloutServer(groups, router=router)
            # A fresh actor answers once its process runs, which on a loaded machine outlasts
            # the probe deadline the binding reads worker URLs within: it would register none.
            ready = [actor.__ray_ready__.remote() for actor in actors]
            await asyncio.wait_for(asyncio.gather(*ready), 300)
            await server.sync_router()
            before = await listed(router)
            if death == "process exits":
                doomed.stop(timeout=0)
            else:
                ray.kill(actors[1])
            await server.probe()  # found dead: taken out of the router at once
            assert await listed(router) == ids(a)
            await server.recover(factory)
            assert await listed(router) == ids(a)  # the replacement lacks the weights
            await server.pause()
            await server.update_weights(lambda update: None, version="v2")
            await server.resume()
            after = await listed(router)
            assert before == ids(a, doomed.url) and after == ids(a, made[0].url)
            async with httpx.AsyncClient(base_url=launched.url, timeout=30) as client:
                for i in range(6):  # round robin: the replacement takes its share
                    body = {"input_ids": [i, 1], "sampling_params": {"max_new_tokens": 2}}
                    (await client.post("/generate", json=body)).raise_for_status()
            assert (await stats(made[0].url))["submitted"] >= 2
            assert (await stats(a))["submitted"] >= 2
            await router.close()
    finally:
        for actor in actors:
            ray.kill(actor)
        doomed.stop(timeout=0)
        for server_ in made:
            server_.stop()


async def test_an_unreachable_router_refuses_before_any_engine_is_paused(
    standins: list[StandInServer],
) -> None:
    a = standins[0].url
    nowhere = SGLangRouter(f"http://127.0.0.1:{free_port()}", timeout=2.0)
    server = RolloutServer(engine_groups([a]), router=nowhere)
    with pytest.raises(RouterError, match=r"router http://127\.0\.0\.1:\d+: .*unreachable"):
        await server.sync_router()
    with pytest.raises(RouterError, match="unreachable"):
        await server.offload()
    assert server.state is S.SERVING
    assert not standins[0].state()["paused"]


async def test_a_wrong_key_is_named_and_a_worker_the_router_lost_is_put_back(
    standins: list[StandInServer],
) -> None:
    a, b, _ = (s.url for s in standins)
    async with router_for(api_key="right-key-5c1e") as launched:
        wrong = SGLangRouter(launched.url, api_key="wrong-key-77aa")
        with pytest.raises(RouterError, match="401, the router refused the control-plane key"):
            await RolloutServer(engine_groups([a, b]), router=wrong).sync_router()
        router = launched.client()
        server = RolloutServer(engine_groups([a, b]), router=router)
        await server.sync_router()
        await router.remove(b)  # the router drops a worker by itself
        assert await listed(router) == ids(a)
        done = await server.sync_router()
        assert ids(*done["added"]) == ids(b) and await listed(router) == ids(a, b)
        await one_cycle(server)
        assert await listed(router) == ids(a, b)
        await router.close()
