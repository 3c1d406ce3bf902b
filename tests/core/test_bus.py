"""The server's event bus: subscribers in order, ``deliver`` awaits what a subscriber starts
before calling the next, ``publish`` refuses a subscriber that would start something nobody
awaits, and a remover takes a subscriber out."""

from __future__ import annotations

import asyncio

import pytest

from rollout_lifecycle.core.bus import Bus, StateEntered
from rollout_lifecycle.core.runner import PhaseSettled
from rollout_lifecycle.core.states import ServerState

S = ServerState


async def test_deliver_awaits_each_subscriber_before_the_next() -> None:
    bus, seen = Bus(), []

    async def slow(event: StateEntered) -> None:
        seen.append("slow started")
        await asyncio.sleep(0)
        seen.append("slow done")

    bus.subscribe(StateEntered, slow)
    bus.subscribe(StateEntered, lambda event: seen.append(f"plain {event.state.value}"))
    bus.subscribe(PhaseSettled, lambda event: seen.append("another kind"))
    await bus.deliver(StateEntered(S.DRAINED, S.PAUSING))
    assert seen == ["slow started", "slow done", "plain drained"]


def test_publish_refuses_a_subscriber_that_returns_an_awaitable() -> None:
    bus = Bus()

    async def follower(event: StateEntered) -> None:
        return None

    bus.subscribe(StateEntered, follower)
    with pytest.raises(TypeError, match=r"StateEntered needs Bus\.deliver"):
        bus.publish(StateEntered(S.SERVING, S.FAILED))


def test_a_removed_subscriber_hears_nothing_and_has_reflects_it() -> None:
    bus, seen = Bus(), []
    remove = bus.subscribe(StateEntered, seen.append)
    assert bus.has(StateEntered) and not bus.has(PhaseSettled)
    remove()
    remove()  # (twice is no error)
    bus.publish(StateEntered(S.SERVING, S.PAUSING))
    assert seen == [] and not bus.has(StateEntered)
