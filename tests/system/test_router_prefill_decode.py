"""Prefill/decode pairs behind a real sglang-router (0.3.2) in prefill/decode mode
(``--pd-disaggregation``): each server is registered as the half its ``/server_info`` names
(SGLang's ``disaggregation_mode``, a prefill one with its ``disaggregation_bootstrap_port``),
a pair that forms a unit (``EngineGroup(unit=2)``) is registered and taken out in one sync,
traffic through the router loses nothing over cycles, and a pair one of whose halves dies is
replaced whole, the new pair registered with its types.

The engines are stand-in SGLang servers (subprocesses) that report a disaggregation mode and
generate as regular servers: the KV transfer from a prefill to a decode server needs a GPU.
What the router listed is read after every call (never half a pair) and every 50 ms
throughout (printed: the router has no call that adds two workers at once, so a read between
its two jobs may show one half for that moment).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import pytest
from system.router_traffic import Traffic, watching

from rollout_lifecycle import (
    EngineGroup,
    LaunchedRouter,
    RolloutServer,
    ServerState,
    SGLangHTTPEngine,
    SGLangRouter,
)
from rollout_lifecycle.contract.urls import url_identity
from rollout_lifecycle.testing.standin import StandInServer

S = ServerState
TOKEN_S = 0.004
CYCLES = 5
#: The bootstrap port of each pair's prefill server.
PORTS = (9301, 9302)


def pair(port: int) -> list[StandInServer]:
    """A prefill stand-in (bootstrap ``port``) and a decode one, not started."""
    return [
        StandInServer(
            token_latency=TOKEN_S,
            disaggregation_mode="prefill",
            disaggregation_bootstrap_port=port,
        ),
        StandInServer(token_latency=TOKEN_S, disaggregation_mode="decode"),
    ]


@pytest.fixture
def pairs() -> Iterator[list[StandInServer]]:
    servers = [s for port in PORTS for s in pair(port)]
    StandInServer.start_all(servers)
    try:
        yield servers
    finally:
        for server in servers:
            server.stop(timeout=0)


async def listing(router: SGLangRouter) -> dict[str, tuple[str, int | None]]:
    """What the router lists: each worker's type and bootstrap port, by address."""
    return {url_identity(w.url): (w.worker_type, w.bootstrap_port) for w in await router.workers()}


def halves(seen: Sequence[frozenset[str]], units: Sequence[Sequence[str]]) -> int:
    """How many of the listings ``seen`` held some but not all members of a unit."""
    keys = [{url_identity(u) for u in unit} for unit in units]
    return sum(1 for s in seen if any(0 < len(s & k) < len(k) for k in keys))


def want(
    servers: Sequence[StandInServer], ports: Sequence[int]
) -> dict[str, tuple[str, int | None]]:
    found: dict[str, tuple[str, int | None]] = {}
    for i, port in enumerate(ports):
        found[url_identity(servers[2 * i].url)] = ("prefill", port)
        found[url_identity(servers[2 * i + 1].url)] = ("decode", None)
    return found


async def test_pairs_are_registered_as_halves_and_replaced_whole_through_cycles(
    pairs: list[StandInServer],
) -> None:
    urls = [s.url for s in pairs]
    units = [urls[:2], urls[2:]]
    made: list[StandInServer] = []

    def new_pair(ids: tuple[str, ...]) -> list[SGLangHTTPEngine]:
        fresh = pair(9303)
        StandInServer.start_all(fresh)
        made.extend(fresh)
        return [SGLangHTTPEngine(s.url) for s in fresh]

    launched = LaunchedRouter(prefill_decode=True)
    after_calls: list[frozenset[str]] = []
    watched: list[frozenset[str]] = []
    try:
        await launched.wait_ready()
        router = launched.client()
        engines = [SGLangHTTPEngine(u) for u in urls]
        server = RolloutServer([EngineGroup("pd", engines, unit=2)], router=router)

        async def read() -> dict[str, tuple[str, int | None]]:
            found = await listing(router)
            after_calls.append(frozenset(found))
            return found

        await server.sync_router()
        assert await read() == want(pairs, PORTS)
        traffic = Traffic(launched.url, senders=4)
        async with watching(router, watched), traffic.running(deadline=60):
            for _ in range(CYCLES):
                await traffic.busy()
                await server.offload()
                assert await read() == {}
                await server.onload_weights()
                await server.onload_kv()
                assert server.state is S.SERVING
                assert await read() == want(pairs, PORTS)
            # a decode half dies: its pair is unhealthy and leaves the router whole, the
            # other pair serves the traffic on
            pairs[3].stop(timeout=0)
            await server.probe()
            assert server.unhealthy_units() == {
                "pd/2-3": "pd/3 dead; recover() replaces the unit whole"
            }
            assert await read() == want(pairs[:2], PORTS[:1])
            await traffic.busy()
            await server.recover(unit_factory=lambda ids: asyncio.to_thread(new_pair, ids))
            assert server.unhealthy_units() == {}
            await server.offload()
            await server.onload_weights()
            # the new pair serves once the weights reach it (a no-op push: stand-ins)
            await server.update_weights(lambda update: None, version="v2")
            await server.onload_kv()
            assert await read() == want([*pairs[:2], *made], [PORTS[0], 9303])
        assert traffic.lost == [] and traffic.completed == traffic.sent
        final_units = [*units[:1], [s.url for s in made]]
        assert halves(after_calls, [*units, final_units[1]]) == 0
        print(
            f"{CYCLES} cycles and a pair replaced: sent={traffic.sent} "
            f"completed={traffic.completed} refused_and_retried={traffic.retried} "
            f"lost={len(traffic.lost)}; router read {len(after_calls)} times after calls "
            f"(0 with half a pair) and {len(watched)} times every 50 ms "
            f"({halves(watched, [*units, final_units[1]])} with half a pair)"
        )
        server.generation.close()
        for engine in engines:
            await engine.close()
    finally:
        launched.stop()
        for server_ in made:
            server_.stop(timeout=0)
