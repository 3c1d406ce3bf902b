"""``recover()`` and ``reset()`` (``core/recovery.Recovery``): dead engines and engines with tags
in an unknown state are replaced through the factory, every replacement made before anything
is retired; each replacement is brought to its group's target in the state the fleet should be
in, while healthy engines already at theirs get no call; and a factory or replacement that
fails is refused with an error naming the engine, the server then telling the truth.

The fleets are simulated engines in process (some wrapped in ``FaultyEngine`` to refuse or lose
one call); what reached each engine is read from its history.
"""

from __future__ import annotations

from typing import Any

import pytest

from rollout_lifecycle import (
    EngineGroup,
    InvalidArgument,
    LifecycleConfig,
    Outcome,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SimulatedEngine,
)
from rollout_lifecycle.testing.faults import FaultyEngine
from rollout_lifecycle.testing.fleets import ROUTES, bring_to
from rollout_lifecycle.testing.fleets import faulty_engines as faulty
from rollout_lifecycle.testing.fleets import received_changes as changes
from rollout_lifecycle.testing.fleets import received_ops as ops
from rollout_lifecycle.testing.fleets import simulated as inner

S = ServerState


def server_and_faulty_groups() -> tuple[RolloutServer, list[FaultyEngine], list[FaultyEngine]]:
    """A group that offloads and one that keeps its memory, two engines each."""
    actor, reward = faulty(2, "a"), faulty(2, "r")
    groups = [EngineGroup("actor", actor), EngineGroup("reward", reward, needs_offload=False)]
    return RolloutServer(groups, LifecycleConfig()), actor, reward


class Factory:
    """Makes fresh simulated engines, and records what it was asked for and what it made."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.made: list[SimulatedEngine] = []

    def __call__(self, engine_id: str) -> SimulatedEngine:
        self.asked.append(engine_id)
        engine = SimulatedEngine(f"{engine_id}-new", token_latency=0.001)
        self.made.append(engine)
        return engine


async def close(*engines: Any) -> None:
    for engine in engines:
        await engine.close()


async def kill(server: RolloutServer, *engines: FaultyEngine) -> None:
    """The engines die and a probe finds them dead."""
    for engine in engines:
        await engine.inner.close()
    await server.probe()
    assert not any(server.snapshot().engines()[e].alive for e in dead_ids(server, engines))


def dead_ids(server: RolloutServer, engines: tuple[FaultyEngine, ...]) -> list[str]:
    return [i for i, h in server.engines().items() if inner(h) in [e.inner for e in engines]]


@pytest.mark.parametrize("start", list(ROUTES))
async def test_dead_engines_are_replaced_at_their_target_and_healthy_ones_get_no_call(
    start: ServerState,
) -> None:
    server, actor, reward = server_and_faulty_groups()
    await bring_to(server, start)
    await kill(server, actor[0], reward[1])
    healthy = [actor[1], reward[0]]
    before = [changes(e) for e in healthy]
    factory = Factory()
    outcomes = await server.recover(factory)
    assert factory.asked == ["actor/0", "reward/1"]
    assert outcomes["actor/0"].ok and outcomes["reward/1"].ok
    assert server.state is start
    # (read once, by the survey before anything is settled on the records)
    assert [changes(e) for e in healthy] == before, "a healthy engine at its target was called"
    new_actor, new_reward = factory.made
    assert inner(server.engines()["actor/0"]) is new_actor
    assert inner(server.engines()["reward/1"]) is new_reward
    # each replacement holds what its group holds in this state, and waits paused (stale)
    # until a weight update reaches it, even where its group serves
    for engine_id, engine, peer in (
        ("actor/0", new_actor, actor[1]),
        ("reward/1", new_reward, reward[0]),
    ):
        record = server.snapshot().engines()[engine_id]
        assert record.alive and record.stale and record.paused, engine_id
        assert engine.state()["paused"], engine_id
        assert engine.state()["released_tags"] == inner(peer).state()["released_tags"], engine_id
        assert list(record.released) == engine.state()["released_tags"], engine_id
    # the dead engines were retired; the healthy ones were not
    assert actor[0].closed_at is not None and reward[1].closed_at is not None
    assert actor[1].closed_at is None and reward[0].closed_at is None
    await close(*actor, *reward, *factory.made)


async def test_every_replacement_is_made_before_any_old_engine_is_retired() -> None:
    engines = faulty(3)
    server = RolloutServer([EngineGroup("actor", engines)])
    await kill(server, engines[0], engines[2])
    retired_when_asked: list[list[bool]] = []
    factory = Factory()

    def watching(engine_id: str) -> SimulatedEngine:
        retired_when_asked.append([e.closed_at is not None for e in engines])
        return factory(engine_id)

    await server.recover(watching)
    assert factory.asked == ["actor/0", "actor/2"]
    assert retired_when_asked == [[False, False, False]] * 2
    assert [e.closed_at is not None for e in engines] == [True, False, True]
    await close(*engines, *factory.made)


async def test_nothing_broken_means_no_factory_call_and_no_engine_call() -> None:
    server, actor, reward = server_and_faulty_groups()
    await server.offload()
    before = [changes(e) for e in actor + reward]
    assert await server.recover(lambda engine_id: pytest.fail("nothing to replace")) == {}
    assert server.state is S.RELEASED
    assert [changes(e) for e in actor + reward] == before  # (each read by the survey)
    await close(*actor, *reward)


async def test_an_engine_whose_release_got_no_answer_is_retired_and_replaced_at_released() -> None:
    engines = faulty(3)
    server = RolloutServer([EngineGroup("actor", engines)])
    engines[1].arm("release_memory_occupation", "drop_after")
    with pytest.raises(PhaseFailed):
        await server.offload()
    assert server.state is S.FAILED
    assert server.snapshot().engines()["actor/1"].uncertain
    factory = Factory()
    outcomes = await server.recover(factory)
    # from failed: the state the healthy engines imply, here 'released'
    assert server.state is S.RELEASED and set(outcomes) == {"actor/1"}
    # the old engine was alive: paused with abort (its requests come back), then closed
    old = inner(engines[1]).history()
    assert [(e["op"], e.get("mode")) for e in old if e["op"] == "pause_generation"][-1] == (
        "pause_generation",
        "abort",
    )
    assert engines[1].closed_at is not None
    (fresh,) = factory.made
    assert sorted(fresh.state()["released_tags"]) == sorted(
        inner(engines[0]).state()["released_tags"]
    )
    assert ops(fresh)[-1] == "release_memory_occupation"
    await server.onload_weights()
    await server.update_weights(lambda update: None, version="v1")
    await server.onload_kv()
    assert server.state is S.SERVING and not fresh.state()["paused"]
    await close(*engines, fresh)


async def test_a_factory_that_raises_changes_nothing() -> None:
    engines = faulty(2)
    server = RolloutServer([EngineGroup("actor", engines)])
    await kill(server, engines[0])
    old = server.engines()["actor/0"]

    def no_capacity(engine_id: str) -> Any:
        raise RuntimeError(f"no capacity for {engine_id}")

    with pytest.raises(RuntimeError, match="no capacity for actor/0"):
        await server.recover(no_capacity)
    assert server.engines()["actor/0"] is old and engines[0].closed_at is None
    assert not server.snapshot().engines()["actor/0"].alive
    assert server.state is S.SERVING
    await close(*engines)


async def test_one_engine_handed_back_for_two_slots_is_refused_before_anything_is_retired() -> None:
    engines = faulty(3)
    server = RolloutServer([EngineGroup("actor", engines)])
    await kill(server, engines[0], engines[1])
    same = SimulatedEngine("same", token_latency=0.001)
    with pytest.raises(
        InvalidArgument, match="the replacement for actor/1 is the replacement for actor/0 already"
    ):
        await server.recover(lambda engine_id: same)
    assert all(e.closed_at is None for e in engines)
    assert [r.alive for r in server.fleet.records()] == [False, False, True]
    assert same.history() == []
    await close(*engines, same)


async def test_a_replacement_dead_at_its_probe_fails_recover_naming_it() -> None:
    engines = faulty(3)
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.pause()
    await kill(server, engines[2])
    before = [changes(e) for e in engines[:2]]
    stillborn = FaultyEngine(SimulatedEngine("stillborn", token_latency=0.001))
    stillborn.arm("server_info", "die")
    with pytest.raises(PhaseFailed) as err:
        await server.recover(lambda engine_id: stillborn)
    assert err.value.phase == "recover" and err.value.failed_engines == ["actor/2"]
    assert err.value.outcomes["actor/2"].outcome is Outcome.DEAD
    assert server.state is S.FAILED
    assert [changes(e) for e in engines[:2]] == before  # nothing reconciled past the probe
    factory = Factory()
    await server.recover(factory)
    assert server.state is S.DRAINED  # what the healthy engines imply
    assert factory.made[0].state()["paused"]
    await close(*engines, stillborn, *factory.made)


async def test_reset_continues_the_groups_that_keep_their_memory_where_they_serve() -> None:
    server, actor, reward = server_and_faulty_groups()
    for engine in reward:
        engine.arm("continue_generation", "reject")
    await server.pause()
    with pytest.raises(PhaseFailed) as err:
        await server.offload()  # released, then the continue of the keepers was refused
    assert err.value.failed_engines == ["reward/0", "reward/1"]
    assert server.state is S.FAILED
    assert all(inner(e).state()["paused"] for e in reward)
    assert await server.reset() is S.RELEASED
    assert not any(inner(e).state()["paused"] for e in reward)
    assert all(inner(e).state()["paused"] for e in actor)
    await close(*actor, *reward)
