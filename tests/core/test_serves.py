"""Which engines serve: one predicate (``Fleet.serves``) for the generation client and the
router binding, so the two never route differently.

Every combination of what a record can say of its engine (dead, paused, pause unknown, stale,
memory released or uncertain), with and without a versioned weight update behind it, and every
server state for a group that offloads and one that keeps its memory: the engine the
in-process client would send a request to is exactly the engine the router lists. And the case
where they used to differ: a drain that failed continues what it paused, and in ``failed`` the
client routes to those engines as the router does, instead of holding every request.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest

from rollout_lifecycle import (
    EngineGroup,
    GenerationClient,
    LifecycleConfig,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SimulatedEngine,
    Tag,
    WeightUpdate,
)
from rollout_lifecycle.core.ledger import may_serve
from rollout_lifecycle.testing.faults import FaultyEngine

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

    async def add(self, url: str, **role: Any) -> None:
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
            routed = server.generation._router._engine_serves(record, server.state)
            assert routed == listed, (flags, versioned, routed, listed)
            # Only an engine whose record says nothing against it serves.
            assert listed is not any(values), (flags, versioned)
            assert "http://engine-b.test:1" in router.urls
            server.generation.close()
            checked += 1
    assert checked == 2 * 2 ** len(FLAGS)


async def test_the_client_and_the_router_agree_in_every_state() -> None:
    """In each state, for an engine whose record serves and one whose record does not, of a
    group that offloads and of one that keeps its memory: listed exactly when routed to, and
    routed to exactly when the record serves and the state lets its group serve."""
    checked = 0
    for state in ServerState:
        router = ListRouter()
        urls = {"actor": "http://actor.test:1", "reward": "http://reward.test:1"}
        groups = [
            EngineGroup("actor", [AtURL(urls["actor"])]),
            EngineGroup("reward", [AtURL(urls["reward"])], needs_offload=False),
        ]
        server = RolloutServer(groups, LifecycleConfig(), router=router)
        server._machine.set_state(state)
        for paused in (False, True):
            for record in server.fleet.records():
                record.paused = paused
            await server.sync_router()
            for record in server.fleet.records():
                listed = urls[record.group] in router.urls
                routed = server.generation._router._engine_serves(record, state)
                offloads = record.group == "actor"
                assert routed == listed == (not paused and may_serve(state, offloads)), (
                    state,
                    record.id,
                    paused,
                )
                checked += 1
        server.generation.close()
    assert checked == len(ServerState) * 2 * 2


async def test_after_a_failed_drain_the_engines_it_continued_serve_for_client_and_router() -> None:
    """A flush refused by one engine fails the offload; the drain continues both engines
    (``continue_on_failure``). In ``failed`` both serve: the router lists them, and a generate
    request is answered by an engine, not held until ``hold_timeout``."""
    router = ListRouter()
    urls = ["http://engine-a.test:1", "http://engine-b.test:1"]
    engines = [FaultyEngine(AtURL(u)) for u in urls]
    engines[1].arm("flush_cache", "reject")
    server = RolloutServer([EngineGroup("actor", engines)], LifecycleConfig(), router=router)
    with pytest.raises(PhaseFailed):
        await server.offload()
    assert server.state is ServerState.FAILED
    assert all(r.serves for r in server.fleet.records())  # continued, nothing released
    assert sorted(router.urls) == urls
    client = GenerationClient(server, hold_timeout=30)
    try:
        out = await client.generate(
            {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
        )
        assert out["meta_info"]["completion_tokens"] == 4
        assert client.stats()["held"] == 0
    finally:
        client.close()
