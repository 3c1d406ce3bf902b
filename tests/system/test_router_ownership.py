"""What a server's router binding may touch, and what its router client leaves open, behind a
real sglang-router (0.3.2).

The binding takes out only the workers it owns: those of the engines in its fleet now, and a
worker it registered itself for an engine since retired (once). A worker that someone else
registers at the URL of a retired engine is theirs, and stays listed. The router client holds
no connection past a call, so a trainer that runs each step in its own event loop
(``asyncio.run``) leaves no socket behind.

Engines are stand-in SGLang servers (subprocesses); the router, the stand-ins and the helpers
are those of ``test_router.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections.abc import Sequence
from typing import Any

import pytest
from system.router_traffic import ids, listed
from system.test_router import TOKEN_S, engine_groups, one_cycle, router_for, standins  # noqa: F401

from rollout_lifecycle import (
    LaunchedRouter,
    RolloutServer,
    RouterError,
    ServerState,
    SGLangHTTPEngine,
    SGLangRouter,
)
from rollout_lifecycle.testing.standin import StandInServer

#: Calls, each in an event loop of its own, that must leave no socket behind.
LOOPS = 50
#: Sockets the process may gain over those calls for reasons of its own (a lazily opened
#: connection elsewhere in the process); one socket per call would be far more.
SOCKET_SLACK = 5


def open_sockets() -> int:
    """How many of this process's file descriptors are sockets."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own descriptor is gone by now)
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def test_a_call_per_event_loop_leaves_no_socket_open(
    standins: list[StandInServer],  # noqa: F811
) -> None:
    a, b, _ = (s.url for s in standins)
    launched = LaunchedRouter()
    try:
        asyncio.run(launched.wait_ready())
        router = launched.client()
        server = RolloutServer(engine_groups([a, b]), router=router)

        async def step() -> dict[str, list[str]]:
            await router.remove(b)  # the router drops a worker; the server puts it back
            return await server.sync_router()

        assert ids(*asyncio.run(server.sync_router())["added"]) == ids(a, b)
        gc.collect()
        before = open_sockets()
        for _ in range(LOOPS):
            done = asyncio.run(step())
            assert ids(*done["added"]) == ids(b) and done["removed"] == []
            assert asyncio.run(server.sync_router()) == {"added": [], "removed": []}
        assert asyncio.run(listed(router)) == ids(a, b)
        gc.collect()
        after = open_sockets()
        assert after - before <= SOCKET_SLACK, (
            f"{after - before} more sockets open after {LOOPS} steps, each in its own event loop"
        )
        asyncio.run(router.close())  # nothing left to close; still safe to call
    finally:
        launched.stop()


class RefusingRemovals:
    """A router client whose removals (or, with ``adds``, registrations) the router refuses
    while ``refuse`` is set."""

    def __init__(self, router: SGLangRouter, *, adds: bool = False) -> None:
        self.router = router
        self.refuse = False
        self.adds = adds

    @property
    def url(self) -> str:
        return self.router.url

    async def workers(self) -> Sequence[Any]:
        return await self.router.workers()

    async def add(self, url: str, **role: Any) -> None:
        if self.refuse and self.adds:
            raise RouterError(self.router.url, f"POST /workers {url}: 503 refused", 503)
        await self.router.add(url, **role)

    async def remove(self, url: str) -> None:
        if self.refuse and not self.adds:
            raise RouterError(self.router.url, f"DELETE {url}: 503 refused", 503)
        await self.router.remove(url)


@pytest.mark.parametrize("when_found_dead", ["router in step", "router refused"])
async def test_a_worker_another_team_registers_at_a_retired_url_stays_listed(
    standins: list[StandInServer],  # noqa: F811
    when_found_dead: str,
) -> None:
    a = standins[0].url
    doomed = StandInServer(token_latency=TOKEN_S).start()
    retired = doomed.url
    made: list[StandInServer] = []
    theirs = StandInServer(token_latency=TOKEN_S, port=doomed.port)

    def factory(engine_id: str) -> SGLangHTTPEngine:
        made.append(StandInServer(token_latency=TOKEN_S).start())
        return SGLangHTTPEngine(made[-1].url)

    try:
        async with router_for() as launched:
            router = launched.client()
            binding = RefusingRemovals(router)
            server = RolloutServer(engine_groups([a, retired]), router=binding)
            await server.sync_router()  # the binding registers both workers
            assert await listed(router) == ids(a, retired)
            doomed.stop(timeout=0)
            binding.refuse = when_found_dead == "router refused"
            await server.probe()  # found dead
            # in step, its worker is taken out now; refused, it outlives its engine
            assert (await router.find(retired) is not None) is binding.refuse
            binding.refuse = False
            await server.recover(factory)
            # the binding took out the worker it registered, either way
            assert await router.find(retired) is None
            assert await listed(router) == ids(a)  # the replacement lacks the weights

            await asyncio.to_thread(theirs.start)  # another team's server, at the retired URL
            other_team = launched.client()
            await other_team.add(retired)
            assert await listed(router) == ids(a, retired)
            assert await server.sync_router() == {"added": [], "removed": []}
            assert await listed(router) == ids(a, retired)
            await server.pause()
            await server.update_weights(lambda update: None, version="v2")
            await server.resume()  # the replacement joins; their worker stays
            assert await listed(router) == ids(a, made[0].url, retired)
            await one_cycle(server)
            assert await listed(router) == ids(a, made[0].url, retired)
            assert await server.sync_router() == {"added": [], "removed": []}
            assert await listed(router) == ids(a, made[0].url, retired)
    finally:
        doomed.stop(timeout=0)
        theirs.stop()
        for server_ in made:
            server_.stop()


async def test_an_onload_whose_engines_serve_unlisted_raises_once_it_is_done(
    standins: list[StandInServer],  # noqa: F811
) -> None:
    """The engines are continued, but the router could not register them: the call does not
    report success while the router sends them nothing; ``sync_router()`` puts it right."""
    a, b, _ = (s.url for s in standins)
    async with router_for() as launched:
        router = launched.client()
        binding = RefusingRemovals(router, adds=True)
        server = RolloutServer(engine_groups([a, b]), router=binding)
        await server.sync_router()
        await server.offload()
        await server.onload_weights()
        binding.refuse = True
        with pytest.raises(RouterError, match="engines serve, but the router could not"):
            await server.onload_kv()
        assert server.state is ServerState.SERVING  # the call did its work
        assert await listed(router) == set()
        binding.refuse = False
        assert ids(*(await server.sync_router())["added"]) == ids(a, b)
        await server.pause()
        await server.resume()  # in step again: nothing to raise
        assert await listed(router) == ids(a, b)
