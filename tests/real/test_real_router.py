"""A real sglang-router (0.3.2) in front of real SGLang 0.5.23 servers on this CPU, driven through
Ray engine actors: traffic through the router loses nothing over 20 cycles in each pause mode,
no worker is listed while its memory is released, and after a server's process dies
``recover()`` gives the router exactly the live servers with the new one included."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import ray
from real.servers import RealServer, RealServerPool, RealSGLang
from system.router_traffic import Traffic, ids, listed

from rollout_lifecycle import (
    Deadlines,
    EngineGroup,
    FromDisk,
    LaunchedRouter,
    LifecycleConfig,
    PauseMode,
    RolloutServer,
    ServerState,
    sglang_http_factory,
    start_engine_actor,
)
from rollout_lifecycle.testing.waits import until

pytestmark = pytest.mark.real_sglang

S = ServerState
CYCLES = 20


@contextlib.asynccontextmanager
async def actors_over(servers: list[RealServer]) -> AsyncIterator[list[Any]]:
    actors = [start_engine_actor(sglang_http_factory(s.url)) for s in servers]
    try:
        await asyncio.wait_for(asyncio.gather(*(a.ping.remote() for a in actors)), 60)
        yield actors
    finally:
        for actor in actors:
            ray.kill(actor)


@pytest.mark.parametrize("mode", [PauseMode.RETRACT, PauseMode.ABORT])
async def test_traffic_through_a_real_router_loses_nothing_over_20_cycles(
    ray_cluster: None, real_sglang: RealSGLang, real_servers: list[RealServer], mode: PauseMode
) -> None:
    urls = [s.url for s in real_servers]
    async with LaunchedRouter() as launched, actors_over(real_servers) as actors:
        router = launched.client()
        config = LifecycleConfig(pause_mode=mode)
        server = RolloutServer([EngineGroup("actor", actors)], config, router=router)
        await server.sync_router()
        assert await listed(router) == ids(*urls)
        traffic = Traffic(launched.url, senders=4, tokens=24, ignore_eos=True)
        listed_while_released: list[set[str]] = []
        try:
            async with traffic.running(deadline=300):
                for n in range(CYCLES):
                    await traffic.busy()  # every offload meets traffic on its way
                    await server.offload()
                    listed_while_released.append(await listed(router))
                    await server.onload_weights()
                    if n % 5 == 4:  # every fifth cycle writes weights too
                        await server.update_weights(FromDisk(real_sglang.model), version=f"v{n}")
                    listed_while_released.append(await listed(router))
                    await server.onload_kv()
                    assert server.state is S.SERVING and await listed(router) == ids(*urls)
        finally:
            await router.close()
        print(
            f"[{mode.value}] {CYCLES} cycles through the router: sent={traffic.sent} "
            f"completed={traffic.completed} refused_and_retried={traffic.retried} "
            f"aborted_and_resubmitted={traffic.resubmitted} lost={len(traffic.lost)}"
        )
        assert traffic.lost == [] and traffic.completed == traffic.sent >= traffic.senders
        assert all(found == set() for found in listed_while_released)


async def test_recover_after_a_real_server_dies_lists_exactly_the_live_servers(
    ray_cluster: None,
    real_sglang: RealSGLang,
    real_pool: RealServerPool,
    real_servers: list[RealServer],
    disposable_real_server: RealServer,
) -> None:
    keep, doomed = real_servers[0], disposable_real_server
    made: list[RealServer] = []
    replacements: list[Any] = []

    async def factory(engine_id: str) -> Any:
        made.append(await asyncio.to_thread(real_pool.disposable))
        replacements.append(start_engine_actor(sglang_http_factory(made[-1].url)))
        return replacements[-1]

    config = LifecycleConfig(deadlines=Deadlines(startup=900.0))
    try:
        async with LaunchedRouter() as launched, actors_over([keep, doomed]) as actors:
            router = launched.client()
            server = RolloutServer([EngineGroup("actor", actors)], config, router=router)
            await server.sync_router()
            before = await listed(router)
            doomed.stop()  # the server's process dies
            await server.probe()
            assert await listed(router) == ids(keep.url)
            await server.recover(factory)
            assert await listed(router) == ids(keep.url)  # the replacement lacks the weights
            await server.pause()
            await server.update_weights(FromDisk(real_sglang.model), version="v-recovered")
            await server.resume()
            after = await listed(router)
            print(f"router workers before {sorted(before)}; after recovery {sorted(after)}")
            assert before == ids(keep.url, doomed.url)
            assert after == ids(keep.url, made[0].url)
            traffic = Traffic(launched.url, senders=2, tokens=4, ignore_eos=True)
            async with traffic.running(deadline=120):
                # Until the replacement has answered a request through the router (bounded).
                await until(
                    lambda: traffic.completed >= 4 and '"POST /generate' in made[0].output(),
                    what="the replacement to answer a request through the router",
                    deadline=120,
                    every=0.1,
                )
            assert traffic.lost == [] and traffic.completed == traffic.sent >= 4
            assert '"POST /generate' in made[0].output(), "the replacement got no traffic"
            await router.close()
    finally:
        for actor in replacements:
            ray.kill(actor)
