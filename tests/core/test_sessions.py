"""Weight writes (``core/sessions.WeightWriter``): a weight-update session on every engine around
the user's push, the version set after it, the prefix cache flushed only where the KV cache is
resident, the engines still serving paused around the write and continued after it; a push or
a begin that fails leaves no session open; a session an earlier write left unknown is closed
before the next opens.

Each test drives a server over simulated engines in process (some wrapped in ``FaultyEngine``)
and reads the calls each engine received from its history.
"""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from rollout_lifecycle import (
    DeadEnginePolicy,
    EngineGroup,
    HookFailed,
    LifecycleConfig,
    Outcome,
    PauseMode,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SimulatedEngine,
    StaleWeights,
    WeightUpdate,
)
from rollout_lifecycle.testing.faults import FaultyEngine
from rollout_lifecycle.testing.fleets import faulty_engines as faulty
from rollout_lifecycle.testing.fleets import received_ops as ops
from rollout_lifecycle.testing.fleets import simulated as inner

S = ServerState

#: The calls of a weight write, as they reach an engine.
SESSION = ["begin_weight_update", "end_weight_update", "update_weight_version"]
#: The same for an engine that served: paused around the write, flushed, continued after it.
AROUND_A_SERVING_ENGINE = ["pause_generation", *SESSION, "flush_cache", "continue_generation"]


def since(engine: SimulatedEngine | FaultyEngine, count: int) -> list[str]:
    """The calls the engine received after its first ``count``, reads of the version aside."""
    return [op for op in ops(engine)[count:] if op != "weight_version"]


class Push:
    """A weight push that records what it was handed and may raise."""

    def __init__(self, error: Exception | None = None) -> None:
        self.updates: list[WeightUpdate] = []
        self.error = error

    async def __call__(self, update: WeightUpdate) -> None:
        self.updates.append(update)
        if self.error is not None:
            raise self.error


def server_and_faulty_groups() -> tuple[RolloutServer, list[FaultyEngine], list[FaultyEngine]]:
    actor, reward = faulty(2, "a"), faulty(2, "r")
    groups = [EngineGroup("actor", actor), EngineGroup("reward", reward, needs_offload=False)]
    return RolloutServer(groups), actor, reward


async def close(*engines: Any) -> None:
    for engine in engines:
        await engine.close()


async def test_a_write_with_the_kv_cache_released_pauses_and_continues_only_what_served() -> None:
    server, actor, reward = server_and_faulty_groups()
    await server.offload()
    await server.onload_weights()
    start = {e: len(ops(e)) for e in actor + reward}
    push = Push()
    await server.update_weights(push, version="v1")
    assert server.state is S.WEIGHTS_RESTORED and server.expected_version == "v1"
    (update,) = push.updates
    assert update.version == "v1"
    assert list(update.engines) == ["actor/0", "actor/1", "reward/0", "reward/1"]
    assert update.engines == server.engines()
    # the offloaded engines: the session and the version; no flush, their KV cache is released
    for engine in actor:
        assert since(engine, start[engine]) == SESSION
    # the engines that served: paused around the write, flushed, continued on the new weights
    for engine in reward:
        assert since(engine, start[engine]) == AROUND_A_SERVING_ENGINE
        assert not inner(engine).state()["paused"]
    for engine in actor + reward:
        assert await inner(engine).weight_version() == "v1"
        assert not inner(engine).state()["weight_update_session_open"]
    await close(*actor, *reward)


async def test_a_write_in_drained_flushes_everywhere_and_continues_nothing() -> None:
    server, actor, reward = server_and_faulty_groups()
    await server.pause()
    start = {e: len(ops(e)) for e in actor + reward}
    await server.update_weights(Push(), version="v1")
    assert server.state is S.DRAINED
    for engine in actor + reward:
        assert since(engine, start[engine]) == [*SESSION, "flush_cache"]
        assert inner(engine).state()["paused"]
    await close(*actor, *reward)


class KeepsItsVersion(SimulatedEngine):
    """Answers a version write and keeps the version it had."""

    async def update_weight_version(self, version: str, *, abort_all_requests: bool = True) -> None:
        return None


async def test_after_a_write_a_keeper_reporting_another_version_waits_and_the_rest_serve() -> None:
    # The write's continue is a reconciliation: engine by engine, not all or nothing.
    actor = faulty(2, "a")
    reward = [
        SimulatedEngine("r0", token_latency=0.001),
        KeepsItsVersion("r1", token_latency=0.001),
    ]
    groups = [EngineGroup("actor", actor), EngineGroup("reward", reward, needs_offload=False)]
    server = RolloutServer(groups)
    await server.offload()
    await server.onload_weights()
    with capture_logs() as logs:
        await server.update_weights(Push(), version="v1")
    assert server.state is S.WEIGHTS_RESTORED
    kept, lagging = server.groups[1].records
    assert not kept.paused and not reward[0].state()["paused"]
    assert lagging.paused and lagging.stale and reward[1].state()["paused"]
    assert [
        (e["engine"], e["expected"], e["reports"])
        for e in logs
        if e["event"] == "engine.waits_for_weights"
    ] == [("reward/1", "v1", "default")]
    # the strict continue of the offloaded groups refuses it by name
    with pytest.raises(StaleWeights, match="reward/1"):
        await server.onload_kv()
    await close(*actor, *reward)


async def test_a_write_in_drained_continues_the_keepers_it_paused() -> None:
    # An offload whose release a hook refused stops in 'drained' with the keepers serving:
    # the write pauses them around itself and lets them serve again.
    server, actor, reward = server_and_faulty_groups()

    def refuse() -> None:
        raise RuntimeError("not now")

    remove = server.on("before_release", refuse)
    with pytest.raises(HookFailed):
        await server.offload()
    remove()
    assert server.state is S.DRAINED
    assert not any(inner(e).state()["paused"] for e in reward)
    start = {e: len(ops(e)) for e in reward}
    await server.update_weights(Push(), version="v1")
    for engine in reward:
        assert since(engine, start[engine]) == AROUND_A_SERVING_ENGINE
        assert not inner(engine).state()["paused"]
    assert all(inner(e).state()["paused"] for e in actor)
    await close(*actor, *reward)


async def test_an_unversioned_write_sets_no_version_and_lets_a_replacement_serve() -> None:
    engines = faulty(2)
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.pause()
    record = server.groups[0].records[1]
    record.stale = True  # a replacement no write has reached yet
    start = [len(ops(e)) for e in engines]
    await server.update_weights(Push())
    assert server.expected_version is None
    assert [since(e, n) for e, n in zip(engines, start, strict=True)] == [
        ["begin_weight_update", "end_weight_update", "flush_cache"]
    ] * 2
    assert not record.stale
    await server.resume()
    assert server.state is S.SERVING and not any(inner(e).state()["paused"] for e in engines)
    await close(*engines)


async def test_a_push_that_raises_closes_every_session_and_sets_no_version() -> None:
    server, actor, reward = server_and_faulty_groups()
    await server.offload()
    await server.onload_weights()
    failing = Push(RuntimeError("trainer lost a shard"))
    with pytest.raises(HookFailed, match="update_weights"):
        await server.update_weights(failing, version="v2")
    assert server.state is S.WEIGHTS_RESTORED  # the caller's error: not a failed server
    assert server.expected_version == "v2"  # only engines that report v2 may generate now
    for engine in actor + reward:
        assert ops(engine)[-1] == "end_weight_update"
        assert "update_weight_version" not in ops(engine)
        assert not inner(engine).state()["weight_update_session_open"]
    # the engines it paused stay paused until a complete write; the next one continues them
    assert all(inner(e).state()["paused"] for e in reward)
    await server.update_weights(Push(), version="v2")
    assert not any(inner(e).state()["paused"] for e in reward)
    assert [await inner(e).weight_version() for e in actor + reward] == ["v2"] * 4
    await close(*actor, *reward)


async def test_after_an_unversioned_push_that_raises_no_engine_generates_until_one_succeeds() -> (
    None
):
    # The push may have written part of the weights, and no version tells which engines hold
    # what, even where an earlier update set one (they all still report it): every engine
    # waits paused for a complete write.
    server, actor, reward = server_and_faulty_groups()
    await server.offload()
    await server.onload_weights()
    await server.update_weights(Push(), version="v1")
    await server.onload_kv()
    await server.offload()
    await server.onload_weights()
    with pytest.raises(HookFailed, match="update_weights"):
        await server.update_weights(Push(RuntimeError("trainer lost a shard")))
    assert server.state is S.WEIGHTS_RESTORED
    # The records still describe the state: a server adopting them agrees, no engine is stale.
    snapshot = server.snapshot()
    assert not any(e.stale for e in snapshot.engines().values())
    RolloutServer(server.groups).adopt(snapshot)
    seen = [len(ops(e)) for e in actor + reward]
    with pytest.raises(StaleWeights, match="lack new weights") as refused:
        await server.onload_kv()
    assert sorted(refused.value.engines) == ["actor/0", "actor/1", "reward/0", "reward/1"]
    for engine, count in zip(actor + reward, seen, strict=True):
        assert inner(engine).state()["paused"]
        assert "continue_generation" not in ops(engine)[count:]
    await server.update_weights(Push(), version="v2")
    await server.onload_kv()
    assert server.state is S.SERVING
    assert not any(inner(e).state()["paused"] for e in actor + reward)
    await close(*actor, *reward)


async def test_a_drained_fleet_whose_unversioned_push_raised_resumes_only_after_a_write() -> None:
    server, actor, reward = server_and_faulty_groups()
    await server.pause()
    with pytest.raises(HookFailed, match="update_weights"):
        await server.update_weights(Push(RuntimeError("trainer lost a shard")))
    assert server.state is S.DRAINED
    RolloutServer(server.groups).adopt(server.snapshot())  # the records imply 'drained'
    with pytest.raises(StaleWeights, match=r"4 engine\(s\) lack new weights"):
        await server.resume()
    assert all(inner(e).state()["paused"] for e in actor + reward)
    await server.update_weights(Push())
    await server.resume()
    assert server.state is S.SERVING
    assert not any(inner(e).state()["paused"] for e in actor + reward)
    await close(*actor, *reward)


async def test_a_begin_refused_on_one_engine_closes_the_sessions_that_opened() -> None:
    engines = faulty(3)
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.pause()
    engines[1].arm("begin_weight_update", "reject")
    push = Push()
    with pytest.raises(PhaseFailed) as err:
        await server.update_weights(push, version="v1")
    assert err.value.phase == "begin_weight_update" and err.value.failed_engines == ["actor/1"]
    assert err.value.outcomes["actor/1"].outcome is Outcome.REJECTED
    assert push.updates == []  # the push never ran
    assert (
        ops(engines[0])[-2:] == ops(engines[2])[-2:] == ["begin_weight_update", "end_weight_update"]
    )
    assert "end_weight_update" not in ops(engines[1])  # no session opened there
    assert not any(inner(e).state()["weight_update_session_open"] for e in engines)
    assert not any(r.session_unknown for r in server.groups[0].records)
    await close(*engines)


async def test_a_session_left_unknown_is_closed_by_reset_before_the_next_opens() -> None:
    engines = faulty(2)
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.pause()
    engines[0].arm("end_weight_update", "drop_after")  # closed, but the answer was lost
    with pytest.raises(PhaseFailed, match="end_weight_update"):
        await server.update_weights(Push(), version="v1")
    assert server.groups[0].records[0].session_unknown
    start = [len(ops(e)) for e in engines]
    assert await server.reset() is S.DRAINED
    # reset() read every engine, then closed the session that may be open, before settling
    assert since(engines[0], start[0])[-1] == "end_weight_update"
    assert "end_weight_update" not in since(engines[1], start[1])
    assert not any(r.session_unknown for r in server.groups[0].records)
    start = [len(ops(e)) for e in engines]
    await server.update_weights(Push(), version="v1")
    assert since(engines[0], start[0]) == [*SESSION, "flush_cache"]
    assert since(engines[1], start[1]) == [*SESSION, "flush_cache"]
    assert not any(r.session_unknown for r in server.groups[0].records)
    await close(*engines)


async def test_engines_paused_in_place_and_dead_engines_are_left_out() -> None:
    engines = faulty(3)
    config = LifecycleConfig(pause_mode=PauseMode.IN_PLACE, dead_engines=DeadEnginePolicy.SKIP)
    server = RolloutServer([EngineGroup("actor", engines)], config)
    await server.pause()
    server.groups[0].records[2].alive = False
    start = [len(ops(e)) for e in engines]
    push = Push()
    await server.update_weights(push, version="v1")
    assert list(push.updates[0].engines) == ["actor/0", "actor/1"]
    # requests keep their KV cache under an in_place pause: no flush is sent under them
    assert [since(e, n) for e, n in zip(engines, start, strict=True)] == [SESSION, SESSION, []]
    await close(*engines)
