"""Which engines serve: one predicate (``EngineRecord.serves``) for the generation client and the
router binding, so the two never route differently.

Every combination of what a record can say of its engine (dead, paused, pause unknown, stale,
memory released or uncertain), with and without a versioned weight update behind it: the
engine the in-process client would send a request to is exactly the engine the router lists.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from rollout_lifecycle import (
    EngineGroup,
    LifecycleConfig,
    RolloutServer,
    ServerState,
    SimulatedEngine,
    Tag,
    WeightUpdate,
)

FLAGS = ("dead", "paused", "pause_unknown", "stale", "released", "uncertain")


class AtURL(SimulatedEngine):
    """A simulated engine with an address, so a router can list it."""

    def __init__(self, url: str) -> None:
        super().__init__(token_latency=0)
        self.url = url


class Worker:
    def __init__(self, url: str) -> None:
        self.url = url


class ListRouter:
    """A router that keeps its workers in a list."""

    url = "http://router.test:1"

    def __init__(self) -> None:
        self.urls: list[str] = []

    async def workers(self) -> Sequence[Any]:
        return [Worker(u) for u in self.urls]

    async def add(self, url: str) -> None:
        self.urls.append(url)

    async def remove(self, url: str) -> None:
        if url in self.urls:  # (taking out a worker not listed is no error)
            self.urls.remove(url)


async def no_op(update: WeightUpdate) -> None:
    return None


async def test_the_client_routes_to_exactly_the_engines_the_router_lists() -> None:
    checked = 0
    for versioned in (False, True):
        for values in itertools.product((False, True), repeat=len(FLAGS)):
            flags = dict(zip(FLAGS, values, strict=True))
            router = ListRouter()
            engines = [AtURL("http://engine-a.test:1"), AtURL("http://engine-b.test:1")]
            server = RolloutServer(
                [EngineGroup("actor", engines)], LifecycleConfig(), router=router
            )
            if versioned:
                async with server.paused():
                    await server.update_weights(no_op, version="v1")
            assert server.state is ServerState.SERVING
            (record, _) = server.fleet.records()
            record.alive = not flags["dead"]
            record.paused = flags["paused"]
            record.pause_unknown = flags["pause_unknown"]
            record.stale = flags["stale"]
            record.released = {Tag.KV_CACHE} if flags["released"] else set()
            record.uncertain = {Tag.WEIGHTS} if flags["uncertain"] else set()
            await server.sync_router()
            listed = "http://engine-a.test:1" in router.urls
            routed = server.generation._router._engine_serves(record)
            assert routed == listed, (flags, versioned, routed, listed)
            # Only an engine whose record says nothing against it serves.
            assert listed is not any(values), (flags, versioned)
            assert "http://engine-b.test:1" in router.urls
            server.generation.close()
            checked += 1
    assert checked == 2 * 2 ** len(FLAGS)
