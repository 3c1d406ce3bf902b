"""The generation client's router (``core/routing.py``) on its own: which serving engine a
request is given, holding it while none serves, and failing it at once when every engine it
could ever use is dead.

The records are set by hand, as the server would leave them; no engine is called. The client's
whole attempt loop over these choices is ``test_generation.py``'s.
"""

from __future__ import annotations

import asyncio

import pytest

from rollout_lifecycle import EngineGroup, RolloutServer, ServerState, SimulatedEngine, Tag
from rollout_lifecycle.core.ledger import EngineRecord
from rollout_lifecycle.core.requests import GenerationTimeout, NoLiveEngine, Request
from rollout_lifecycle.core.routing import Router
from rollout_lifecycle.testing import until

#: Far longer than any test may take: a wait that ends on it has failed the test by then.
LONG = 3600.0
#: The outer bound of a wait that must end on a fact.
BOUND = 30.0


def make_server(actors: int = 2, refs: int = 0) -> RolloutServer:
    groups = [EngineGroup("actor", [SimulatedEngine(f"a{i}") for i in range(actors)])]
    if refs:
        engines = [SimulatedEngine(f"r{i}") for i in range(refs)]
        groups.append(EngineGroup("ref", engines, needs_offload=False))
    return RolloutServer(groups)


def make_router(
    server: RolloutServer, *, hold_timeout: float = LONG, request_timeout: float = LONG
) -> tuple[Router, dict[str, int]]:
    """A router whose held requests look again only when ``notify()`` wakes them."""
    counts = {"held": 0}
    return Router(server, counts, hold_timeout, request_timeout, lambda: LONG), counts


def work(group: str | None = None) -> Request:
    return Request.prepare({"input_ids": [1, 2, 3]}, group)


def records(server: RolloutServer) -> dict[str, EngineRecord]:
    return {r.id: r for r in server.fleet.records()}


def far() -> float:
    """A request deadline that never comes during a test."""
    return asyncio.get_running_loop().time() + LONG


async def test_pick_takes_the_serving_engine_with_fewest_outstanding_in_the_asked_group() -> None:
    server = make_server(actors=3, refs=1)
    router, _ = make_router(server)
    by_id = records(server)
    router.outstanding.update({"actor/0": 2, "actor/1": 1, "actor/2": 1, "ref/0": 0})
    assert router.pick(work("actor")) is by_id["actor/1"]  # a tie goes to the first
    by_id["actor/1"].paused = True
    assert router.pick(work("actor")) is by_id["actor/2"]
    assert router.pick(work()) is by_id["ref/0"]  # any group: the least loaded of all
    assert router.pick(work("ref")) is by_id["ref/0"]
    by_id["actor/2"].released = {Tag.KV_CACHE}
    by_id["actor/0"].alive = False
    assert router.pick(work("actor")) is None


async def test_an_engine_where_the_request_was_lost_is_used_only_when_no_other_serves() -> None:
    server = make_server(actors=2)
    router, _ = make_router(server)
    by_id = records(server)
    router.outstanding.update({"actor/0": 0, "actor/1": 5})
    request = work()
    request.avoid.add("actor/0")
    assert router.pick(request) is by_id["actor/1"]  # busier, but not where it was lost
    by_id["actor/1"].paused = True
    assert router.pick(request) is by_id["actor/0"]  # better than holding it


async def test_an_engine_seen_dying_is_not_picked_but_a_replacement_or_restart_there_is() -> None:
    server = make_server(actors=1)
    router, _ = make_router(server)
    (record,) = server.fleet.records()
    record.incarnation = "first"
    router.saw_die(record.id, record.handle, record.incarnation)
    assert router.seen_dead(record) and router.pick(work()) is None
    assert record.alive  # the server has not noticed: only this client saw it die
    record.incarnation = "restarted"  # a new process at the same address
    assert not router.seen_dead(record) and router.pick(work()) is record
    record.incarnation = "first"
    assert router.pick(work()) is None
    record.renew(SimulatedEngine("replacement"))  # another engine in the slot
    record.stale = False  # (a weight update has reached it)
    assert not router.seen_dead(record) and router.pick(work()) is record


async def test_a_request_whose_engines_all_died_under_requests_fails_without_being_held() -> None:
    server = make_server(actors=2, refs=1)
    router, counts = make_router(server)
    for record in server.fleet.records():
        if record.group == "actor":
            router.saw_die(record.id, record.handle, record.incarnation)
    with pytest.raises(NoLiveEngine) as info:
        await asyncio.wait_for(router.acquire(work("actor"), far()), BOUND)
    assert info.value.group == "actor" and info.value.state == "serving"
    assert "dead: actor/0, actor/1" in str(info.value)
    assert info.value.partial is None  # nothing was produced
    assert counts["held"] == 0 and router.holding == 0
    # another group still serves a request for any group
    assert (await asyncio.wait_for(router.acquire(work(), far()), BOUND)).id == "ref/0"


async def test_a_hold_that_times_out_says_why_each_engine_does_not_serve() -> None:
    server = make_server(actors=6)
    router, counts = make_router(server, hold_timeout=0.0)
    r = list(server.fleet.records())
    r[0].alive = False
    router.saw_die(r[1].id, r[1].handle, r[1].incarnation)
    r[2].paused = True
    r[3].released = {Tag.WEIGHTS}
    r[4].stale = True
    r[5].pause_unknown = True
    with pytest.raises(GenerationTimeout) as info:
        await asyncio.wait_for(router.acquire(work(), far()), BOUND)
    error = info.value
    assert (error.limit, error.state, error.partial) == ("hold_timeout", "serving", None)
    for note in (
        "actor/0 dead",
        "actor/1 died under a request",
        "actor/2 paused",
        "actor/3 holds released memory",
        "actor/4 is a fresh server no weight update has reached",
        "actor/5 paused",
    ):
        assert note in str(error), note
    server._versions.expected = "v7"
    with pytest.raises(GenerationTimeout, match="actor/4 lacks weight version 'v7'"):
        await asyncio.wait_for(router.acquire(work(), far()), BOUND)
    server._machine.set_state(ServerState.RELEASED)
    with pytest.raises(GenerationTimeout, match="any group does not serve in that state"):
        await asyncio.wait_for(router.acquire(work(), far()), BOUND)
    assert counts["held"] == 0  # each failed on its first look: none was held


async def test_the_request_deadline_ends_a_hold_before_hold_timeout() -> None:
    server = make_server(actors=1)
    router, counts = make_router(server, request_timeout=0.05)
    (record,) = server.fleet.records()
    record.paused = True
    deadline = asyncio.get_running_loop().time() + 0.05
    with pytest.raises(GenerationTimeout) as info:
        await asyncio.wait_for(router.acquire(work(), deadline), BOUND)
    assert info.value.limit == "request_timeout"
    assert "request_timeout=0.05s" in str(info.value) and "actor/0 paused" in str(info.value)
    assert info.value.waited > 0
    assert counts["held"] == 1 and router.holding == 0


async def test_a_held_request_is_counted_once_and_takes_the_engine_a_notify_finds() -> None:
    server = make_server(actors=2)
    router, counts = make_router(server)
    first, second = server.fleet.records()
    first.paused = second.paused = True
    looks: list[EngineRecord | None] = []
    pick = router.pick

    def counted(request: Request) -> EngineRecord | None:
        looks.append(pick(request))
        return looks[-1]

    router.pick = counted  # type: ignore[method-assign]
    task = asyncio.ensure_future(router.acquire(work(), far()))
    await until(lambda: router.holding == 1 and len(looks) == 1, what="the request to be held")
    router.notify()  # nothing changed: it looks again and holds on
    await until(lambda: len(looks) == 2, what="a second look")
    assert not task.done() and router.holding == 1
    second.paused = False
    router.notify()
    assert await asyncio.wait_for(task, BOUND) is second
    assert looks == [None, None, second]
    assert counts["held"] == 1 and router.holding == 0


async def test_a_held_request_cancelled_by_its_caller_is_no_longer_holding() -> None:
    server = make_server(actors=1)
    router, counts = make_router(server)
    (record,) = server.fleet.records()
    record.paused = True
    task = asyncio.ensure_future(router.acquire(work(), far()))
    await until(lambda: router.holding == 1, what="the request to be held")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert router.holding == 0 and counts["held"] == 1
    record.paused = False  # a later request is served at once
    assert await asyncio.wait_for(router.acquire(work(), far()), BOUND) is record
