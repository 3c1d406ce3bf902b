"""Engines joining and leaving a running fleet (``core/membership.py``): ``add_engines`` and
``remove_engines`` in every settled state, on simulated engines in this process, with the engines'
own histories as the evidence. A joining engine is brought to its group's memory state and waits
paused, stale, until a weight push reaches it; a leaving engine hands its requests back (nothing
is lost), is drained and released, and the rest of the fleet is untouched.

The router's side (a joining engine listed only once it serves, a leaving one taken out before
its pause) is ``test_router_sync.py``'s; engines joining and leaving under random calls and
faults, ``test_stateful.py``'s; on Ray actors with the cluster's claims,
``tests/system/test_lease.py``'s."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollout_lifecycle import (
    ALL_TAGS,
    KV_TAGS,
    EngineGroup,
    EngineState,
    FromDisk,
    IllegalTransition,
    InvalidArgument,
    LifecycleConfig,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SimulatedEngine,
)
from rollout_lifecycle.testing import cycle_order_violations, until
from rollout_lifecycle.testing.barriers import fatal_calls
from rollout_lifecycle.testing.fleets import ROUTES, bring_to, faulty_engines

S = ServerState
STATES = list(ROUTES)
TOKENS = 48


def sims(labels: list[str]) -> list[SimulatedEngine]:
    return [SimulatedEngine(label, token_latency=0.002) for label in labels]


def requests(n: int) -> list[dict[str, Any]]:
    return [
        {"input_ids": [1, 2, i], "sampling_params": {"max_new_tokens": TOKENS}} for i in range(n)
    ]


async def violations(
    engines: list[SimulatedEngine], since: dict[str, int] | None = None
) -> list[str]:
    """Barrier violations across ``engines`` round by round, each history from ``since`` (the
    moment an engine joined: before that it had no part in the fleet's rounds), and every
    fatal call."""
    since = since or {}
    return cycle_order_violations({e.label: e.history()[since.get(e.label, 0) :] for e in engines})


async def cycle(server: RolloutServer, version: str) -> None:
    await server.offload()
    await server.onload_weights()
    await server.update_weights(FromDisk(f"/ckpt/{version}"), version, verify=True)
    await server.onload_kv()


async def back_to_serving(server: RolloutServer, state: ServerState) -> None:
    """From ``state`` back to serving, through a weight push where the fleet has its weights
    resident (a stale engine holds a continue back until one reaches it, as after a
    recover)."""
    if state is S.RELEASED:
        await server.onload_weights()
    if state is not S.SERVING:
        await server.update_weights(FromDisk("/ckpt/v0"), "v0")
        await server.onload()


def ops(engine: SimulatedEngine) -> list[str]:
    return [e["op"] for e in engine.history()]


@pytest.mark.parametrize("state", STATES, ids=[s.value for s in STATES])
async def test_an_engine_joins_in_every_state_and_serves_once_the_weights_reach_it(
    state: ServerState,
) -> None:
    """In each settled state, a fresh engine joins with the group's next id, is brought to the
    group's memory state there (released where the group is), never serves before a push
    reaches it, and serves after the next cycle's verified push; the fleet's state is
    unchanged and no engine sees a call out of order."""
    engines = sims(["a", "b"])
    server = RolloutServer([EngineGroup("actor", engines)])
    await bring_to(server, state)
    joining = SimulatedEngine("c", token_latency=0.002)
    assert await server.add_engines("actor", [joining]) == ["actor/2"]
    assert server.state is state
    record = {r.id: r for r in server.fleet.records()}["actor/2"]
    assert record.stale
    seen = joining.state()
    if state is S.SERVING:
        assert record.state is EngineState.WAITING and seen["paused"]
    elif state in (S.RELEASED,):
        assert record.state is EngineState.RELEASED
        assert sorted(seen["released_tags"]) == sorted(t.value for t in ALL_TAGS)
    elif state is S.WEIGHTS_RESTORED:
        assert seen["paused"] and sorted(seen["released_tags"]) == sorted(t.value for t in KV_TAGS)
    else:
        assert seen["paused"] and not seen["released_tags"]
    assert "generate" not in ops(joining)
    joined = {e.label: len(e.history()) for e in [*engines, joining]}
    await back_to_serving(server, state)
    await cycle(server, "v1")
    assert server.state is S.SERVING
    assert server.fleet.count([EngineState.SERVING]) == 3
    answers = await server.generate_batch(requests(9))
    assert [len(a["output_ids"]) for a in answers] == [TOKENS] * 9
    assert joining.stats()["submitted"] >= 1  # (the router spreads: the new engine serves too)
    assert await violations([*engines, joining], joined) == []
    assert await violations([joining]) == []


@pytest.mark.parametrize("state", STATES, ids=[s.value for s in STATES])
async def test_an_engine_leaves_in_every_state_released_and_the_rest_untouched(
    state: ServerState,
) -> None:
    """In each settled state, a leaving engine is out of the records, paused, flushed, every
    tag it held released; the others see no call; the state is unchanged, and the fleet
    cycles on without it."""
    engines = sims(["a", "b", "c"])
    server = RolloutServer([EngineGroup("actor", engines)])
    await bring_to(server, state)
    before = {e.label: len(e.history()) for e in engines}
    outcomes = await server.remove_engines(["actor/1"])
    assert all(o.ok for o in outcomes.values()) and set(outcomes) == {"actor/1"}
    assert server.state is state
    assert [r.id for r in server.fleet.records()] == ["actor/0", "actor/2"]
    assert fatal_calls({"b": engines[1].history()}) == []
    left = engines[1].state()
    assert left["paused"] and sorted(left["released_tags"]) == sorted(t.value for t in ALL_TAGS)
    assert ops(engines[1])[-2:] == ["pause_generation", "close"]  # (stopped, as recover retires)
    for kept in (engines[0], engines[2]):
        assert len(kept.history()) == before[kept.label]
    await back_to_serving(server, state)
    await cycle(server, "v1")
    assert server.state is S.SERVING
    calls_after = len(engines[1].history())
    await server.generate_batch(requests(4))
    assert len(engines[1].history()) == calls_after
    assert await violations([engines[0], engines[2]]) == []


@pytest.mark.parametrize("mode", ["retract", "abort"])
@pytest.mark.parametrize("state", [S.SERVING, S.DRAINED], ids=["serving", "drained"])
async def test_requests_on_a_leaving_engine_are_resubmitted_and_none_is_lost(
    mode: str, state: ServerState
) -> None:
    """With requests decoding on every engine, one leaves (serving), or the fleet is paused
    first (drained: in retract mode the requests wait inside the paused engines): what the
    leaving engine held comes back aborted (partial) and runs again on the engines that stay;
    every answer is whole."""
    engines = sims(["a", "b", "c"])
    server = RolloutServer([EngineGroup("actor", engines)], LifecycleConfig(pause_mode=mode))
    batch = asyncio.ensure_future(server.generate_batch(requests(12)))

    async def everywhere() -> bool:
        return all(e.stats()["submitted"] >= 1 for e in engines)

    await until(everywhere, what="a request on every engine")
    await bring_to(server, state)
    await server.remove_engines(["actor/0"])
    if state is S.DRAINED:
        await server.resume()
    answers = await asyncio.wait_for(batch, 10)
    assert [len(a["output_ids"]) for a in answers] == [TOKENS] * 12
    assert {a["meta_info"]["finish_reason"]["type"] for a in answers} == {"length"}
    assert engines[0].state()["in_flight"] == []
    assert await violations(engines[1:]) == []
    assert fatal_calls({"a": engines[0].history()}) == []


async def test_ids_are_never_given_twice() -> None:
    engines = sims(["a", "b"])
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.remove_engines(["actor/1"])
    assert await server.add_engines("actor", sims(["c", "d"])) == ["actor/2", "actor/3"]
    await server.remove_engines(["actor/3"])
    assert await server.add_engines("actor", sims(["e"])) == ["actor/4"]
    assert [r.id for r in server.fleet.records()] == ["actor/0", "actor/2", "actor/4"]


async def test_a_joining_engine_that_is_not_fresh_joins_not_and_nothing_else_is_touched() -> None:
    engines = sims(["a", "b"])
    server = RolloutServer([EngineGroup("actor", engines)])
    paused = SimulatedEngine("p", token_latency=0.002)
    await paused.pause_generation("retract")  # (someone else's engine, paused)
    with pytest.raises(PhaseFailed, match="join_probe"):
        await server.add_engines("actor", [SimulatedEngine("ok"), paused])
    assert [r.id for r in server.fleet.records()] == ["actor/0", "actor/1"]
    assert server.state is S.SERVING
    assert not any(op.endswith("memory_occupation") for op in ops(paused))
    assert all("pause_generation" not in ops(e) for e in engines)


async def test_bad_joins_and_leaves_are_refused_before_anything_is_sent() -> None:
    engines = sims(["a", "b"])
    server = RolloutServer(
        [EngineGroup("actor", engines), EngineGroup("pd", sims(["p", "d"]), unit=2)]
    )
    with pytest.raises(InvalidArgument, match="no group 'critic'"):
        await server.add_engines("critic", sims(["c"]))
    with pytest.raises(InvalidArgument, match="engine actor/0 already"):
        await server.add_engines("actor", [engines[0]])
    twice = SimulatedEngine("t")
    with pytest.raises(InvalidArgument, match="give each engine once"):
        await server.add_engines("actor", [twice, twice])
    with pytest.raises(InvalidArgument, match="units of 2"):
        await server.add_engines("pd", sims(["x", "y"]))
    with pytest.raises(InvalidArgument, match="non-empty"):
        await server.add_engines("actor", [])
    with pytest.raises(InvalidArgument, match="no engine 'actor/9'"):
        await server.remove_engines(["actor/9"])
    with pytest.raises(InvalidArgument, match="given twice"):
        await server.remove_engines(["actor/0", "actor/0"])
    with pytest.raises(InvalidArgument, match="leave group 'actor' with no engine"):
        await server.remove_engines(["actor/0", "actor/1"])
    with pytest.raises(InvalidArgument, match="member of unit"):
        await server.remove_engines(["pd/0"])
    assert [r.id for r in server.fleet.records()] == ["actor/0", "actor/1", "pd/0", "pd/1"]
    assert all(e.history() == [] for e in engines)


async def test_joining_and_leaving_are_refused_in_failed() -> None:
    engines = faulty_engines(2)
    server = RolloutServer([EngineGroup("actor", engines)])
    engines[0].arm("release_memory_occupation", "drop_after")
    with pytest.raises(PhaseFailed):
        await server.offload()
    assert server.state is S.FAILED
    with pytest.raises(IllegalTransition, match="recover"):
        await server.add_engines("actor", sims(["c"]))
    with pytest.raises(IllegalTransition, match="recover"):
        await server.remove_engines(["actor/0"])


async def test_a_new_server_adopts_a_fleet_whose_members_changed() -> None:
    """After engines joined and left, a new server built with the journal's indexes
    (``EngineGroup(indexes=...)``) adopts the last entry and goes on; one built without them
    is refused naming both sets of ids."""
    entries: list[Any] = []
    engines = sims(["a", "b", "c"])
    server = RolloutServer([EngineGroup("actor", engines)], journal=entries.append)
    await server.remove_engines(["actor/0"])
    joining = SimulatedEngine("d", token_latency=0.002)
    await server.add_engines("actor", [joining])
    await server.offload()
    last = entries[-1]
    assert last.ids("actor") == ["actor/1", "actor/2", "actor/3"]
    assert last.indexes("actor") == [1, 2, 3]
    members = [engines[1], engines[2], joining]
    naive = RolloutServer([EngineGroup("actor", members)], name="naive")
    with pytest.raises(InvalidArgument, match="not this server's"):
        naive.adopt(last)
    group = EngineGroup("actor", members, indexes=last.indexes("actor"))
    adopter = RolloutServer([group], name="adopter")
    adopter.adopt(last)
    assert adopter.state is S.RELEASED
    assert await adopter.add_engines("actor", sims(["e"])) == ["actor/4"]
    await adopter.onload_weights()
    await adopter.update_weights(FromDisk("/ckpt/v1"), "v1")
    await adopter.onload_kv()
    assert adopter.fleet.count([EngineState.SERVING]) == 4


def test_indexes_must_fit_the_engines() -> None:
    with pytest.raises(InvalidArgument, match="2 engines but 1 indexes"):
        EngineGroup("actor", sims(["a", "b"]), indexes=[3])
    with pytest.raises(InvalidArgument, match="repeat"):
        EngineGroup("actor", sims(["a", "b"]), indexes=[3, 3])
    with pytest.raises(InvalidArgument, match="index of group 'actor'"):
        EngineGroup("actor", sims(["a", "b"]), indexes=[3, -1])
    with pytest.raises(InvalidArgument, match="made of units"):
        EngineGroup("pd", sims(["a", "b"]), unit=2, indexes=[2, 3])


async def test_an_engine_kept_by_the_caller_is_left_paused_and_released_not_stopped() -> None:
    engines = sims(["a", "b"])
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.remove_engines(["actor/0"], stop=False)
    kept = engines[0].state()
    assert kept["paused"] and sorted(kept["released_tags"]) == sorted(t.value for t in ALL_TAGS)
    assert "close" not in ops(engines[0])
    with pytest.raises(InvalidArgument, match="stop must be a bool"):
        await server.remove_engines(["actor/1"], stop="no")  # type: ignore[arg-type]


async def test_a_join_that_fails_part_way_leaves_the_engine_in_the_fleet_for_recover() -> None:
    """A joining engine whose release is refused (the fleet is released) is the fleet's but not
    where its group's state holds it: the server fails, and recover() settles it there."""
    engines = faulty_engines(3)
    server = RolloutServer([EngineGroup("actor", engines[:2])])
    await server.offload()
    engines[2].arm("release_memory_occupation", "reject")
    with pytest.raises(PhaseFailed, match="join_release"):
        await server.add_engines("actor", [engines[2]])
    assert server.state is S.FAILED
    assert [r.id for r in server.fleet.records()] == ["actor/0", "actor/1", "actor/2"]
    await server.recover(lambda engine_id: pytest.fail("nothing to replace"))
    assert server.state is S.RELEASED
    assert sorted(engines[2].inner.state()["released_tags"]) == sorted(t.value for t in ALL_TAGS)


async def test_a_leave_that_fails_part_way_keeps_the_engine_and_fails_the_server() -> None:
    """A leaving engine whose pause is refused stays the fleet's (its calls are the fleet's to
    wait for): the server fails; after recover() it leaves."""
    engines = faulty_engines(2)
    server = RolloutServer([EngineGroup("actor", engines)])
    engines[1].arm("pause_generation", "reject")
    with pytest.raises(PhaseFailed, match="leave_pause"):
        await server.remove_engines(["actor/1"])
    assert server.state is S.FAILED
    assert [r.id for r in server.fleet.records()] == ["actor/0", "actor/1"]
    await server.recover(lambda engine_id: pytest.fail("nothing to replace"))
    assert server.state is S.SERVING
    await server.remove_engines(["actor/1"])
    assert [r.id for r in server.fleet.records()] == ["actor/0"]
