"""The lifecycle's phases (``core/phases.Phases``): the offload's preflight, the drain (pause,
then flush, or no flush under an ``in_place`` pause) and what it undoes when it fails, the
release and the groups that keep their memory, and the restore of only the tags released.

Each test drives a server over simulated engines in process (some wrapped in ``FaultyEngine``
to refuse one call) and reads what reached each engine from its history.
"""

from __future__ import annotations

import pytest

from rollout_lifecycle import (
    DeadEnginePolicy,
    EngineGroup,
    FromDisk,
    HookFailed,
    IllegalEngineOp,
    LifecycleConfig,
    LifecycleEvent,
    Outcome,
    PauseMode,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SimulatedEngine,
    Tag,
)
from rollout_lifecycle.testing import calls_received
from rollout_lifecycle.testing.faults import FaultyEngine
from rollout_lifecycle.testing.fleets import faulty_engines as faulty
from rollout_lifecycle.testing.fleets import received_ops as ops
from rollout_lifecycle.testing.fleets import simulated_engines as sims

S = ServerState


def paused(engine: SimulatedEngine | FaultyEngine) -> bool:
    inner = engine.inner if isinstance(engine, FaultyEngine) else engine
    assert isinstance(inner, SimulatedEngine)
    return bool(inner.state()["paused"])


async def close(*engines: SimulatedEngine | FaultyEngine) -> None:
    for engine in engines:
        await engine.close()


# -- the offload's preflight ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["released", "uncertain"])
async def test_an_offload_a_release_would_refuse_is_refused_before_any_pause(kind: str) -> None:
    actor, reward = sims(2, "a"), sims(1, "r")
    server = RolloutServer(
        [EngineGroup("actor", actor), EngineGroup("reward", reward, needs_offload=False)]
    )
    getattr(server.groups[0].records[1], kind).add(Tag.KV_CACHE)
    with pytest.raises(IllegalEngineOp, match=r"actor/1.*\['kv_cache'\] are already released"):
        await server.offload()
    assert server.state is S.SERVING
    assert all(ops(e) == [] for e in actor + reward)
    await close(*actor, *reward)


async def test_an_offload_with_a_dead_offloaded_engine_is_refused_only_under_fail() -> None:
    actor, reward = sims(3, "a"), sims(1, "r")
    groups = [EngineGroup("actor", actor), EngineGroup("reward", reward, needs_offload=False)]
    server = RolloutServer(groups)
    server.groups[0].records[0].alive = False
    server.groups[0].records[2].alive = False
    with pytest.raises(IllegalEngineOp, match=r"actor/0, actor/2.*recover\(\) them first"):
        await server.offload()
    assert server.state is S.SERVING and all(ops(e) == [] for e in actor + reward)
    # under SKIP the offload goes on with the live engine, and the dead ones get nothing
    skip = RolloutServer(
        [EngineGroup("actor", actor), EngineGroup("reward", reward, needs_offload=False)],
        LifecycleConfig(dead_engines=DeadEnginePolicy.SKIP),
    )
    skip.groups[0].records[0].alive = False
    skip.groups[0].records[2].alive = False
    await skip.offload()
    assert skip.state is S.RELEASED
    assert ops(actor[1]) == ["pause_generation", "flush_cache", "release_memory_occupation"]
    assert ops(actor[0]) == ops(actor[2]) == []
    await close(*actor, *reward)


# -- the drain ------------------------------------------------------------------------------------


async def test_an_in_place_drain_pauses_and_sends_no_flush() -> None:
    engines = sims(2)
    server = RolloutServer(
        [EngineGroup("actor", engines)], LifecycleConfig(pause_mode=PauseMode.IN_PLACE)
    )
    await server.pause()
    assert server.state is S.DRAINED
    assert all(ops(e) == ["pause_generation"] for e in engines)
    assert all(e.state()["pause_mode"] == "in_place" for e in engines)
    records = server.groups[0].records
    assert all(r.paused and r.pause_mode is PauseMode.IN_PLACE and not r.flushed for r in records)
    await server.resume()
    assert all(ops(e) == ["pause_generation", "continue_generation"] for e in engines)
    await close(*engines)


async def test_a_flush_that_fails_continues_every_paused_engine_and_releases_nothing() -> None:
    engines = faulty(3)
    server = RolloutServer([EngineGroup("actor", engines)])
    engines[1].arm("flush_cache", "reject")
    with pytest.raises(PhaseFailed) as err:
        await server.offload()
    assert err.value.phase == "flush" and err.value.failed_engines == ["actor/1"]
    assert err.value.outcomes["actor/1"].outcome is Outcome.REJECTED
    assert server.state is S.FAILED
    for engine in engines:
        assert "release_memory_occupation" not in ops(engine)
        assert ops(engine)[-1] == "continue_generation"
        assert not paused(engine)
    assert not any(r.paused for r in server.groups[0].records)
    await close(*engines)


async def test_undoing_a_failed_drain_continues_only_the_engines_with_the_fleets_weights() -> None:
    """The undo of a failed drain is a reconciliation back to ``serving``: an engine that
    reports other weights than the fleet's (its version changed behind the server's back) is
    not continued onto them; it waits paused, stale, for an update, and the others serve."""
    engines = faulty(3)
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.pause()
    await server.update_weights(FromDisk("/ckpt/1"), "v1")
    await server.resume()
    await engines[0].inner.update_weight_version("v0", abort_all_requests=False)
    engines[2].arm("flush_cache", "reject")
    with pytest.raises(PhaseFailed, match="'flush'"):
        await server.offload()
    assert [paused(e) for e in engines] == [True, False, False]
    assert "continue_generation" not in ops(engines[0])[-3:]
    record = server.groups[0].records[0]
    assert record.paused and record.stale
    # an update reaches it and it serves again
    assert await server.reset() is S.SERVING
    await server.pause()
    await server.update_weights(FromDisk("/ckpt/2"), "v2")
    await server.resume()
    assert not any(paused(e) for e in engines)
    await close(*engines)


async def test_without_continue_on_failure_a_failed_pause_leaves_the_paused_paused() -> None:
    engines = faulty(3)
    config = LifecycleConfig(continue_on_failure=False)
    server = RolloutServer([EngineGroup("actor", engines)], config)
    engines[2].arm("pause_generation", "reject")
    with pytest.raises(PhaseFailed) as err:
        await server.pause()
    assert err.value.phase == "pause" and err.value.failed_engines == ["actor/2"]
    assert server.state is S.FAILED
    assert [paused(e) for e in engines] == [True, True, False]
    assert all("continue_generation" not in ops(e) for e in engines)
    assert [r.paused for r in server.groups[0].records] == [True, True, False]
    await close(*engines)


async def test_a_failed_pause_names_an_engine_known_dead_as_not_attempted() -> None:
    engines = faulty(3)
    server = RolloutServer([EngineGroup("actor", engines)])
    server.groups[0].records[0].alive = False
    engines[1].arm("pause_generation", "reject")
    with pytest.raises(PhaseFailed) as err:
        await server.pause()
    outcomes = err.value.outcomes
    assert outcomes["actor/0"].outcome is Outcome.NOT_ATTEMPTED
    assert outcomes["actor/0"].detail == "engine already dead"
    assert outcomes["actor/1"].outcome is Outcome.REJECTED and outcomes["actor/2"].ok
    assert err.value.failed_engines == ["actor/0", "actor/1"]
    assert ops(engines[0]) == []
    await close(*engines)


async def test_a_drain_a_flush_hook_refuses_is_undone_even_without_continue_on_failure() -> None:
    engines = sims(2)
    server = RolloutServer(
        [EngineGroup("actor", engines)], LifecycleConfig(continue_on_failure=False)
    )

    def refuse(event: LifecycleEvent) -> None:
        raise RuntimeError("not now")

    remove = server.on("before_flush", refuse)
    with pytest.raises(HookFailed, match="before_flush"):
        await server.pause()
    assert server.state is S.SERVING
    assert all(ops(e) == ["pause_generation", "continue_generation"] for e in engines)
    assert not any(e.state()["paused"] for e in engines)
    remove()
    await server.pause()
    assert server.state is S.DRAINED
    await close(*engines)


# -- the release and the restores -----------------------------------------------------------------


async def test_an_offload_from_a_full_pause_lets_the_groups_that_keep_their_memory_serve() -> None:
    actor, reward = sims(2, "a"), sims(2, "r")
    server = RolloutServer(
        [EngineGroup("actor", actor), EngineGroup("reward", reward, needs_offload=False)]
    )
    await server.pause()  # every group paused
    assert all(e.state()["paused"] for e in actor + reward)
    await server.offload()  # from drained: only the release runs, then the keepers serve
    assert server.state is S.RELEASED
    for engine in reward:
        assert ops(engine) == ["pause_generation", "flush_cache", "continue_generation"]
        assert not engine.state()["paused"] and engine.state()["released_tags"] == []
    for engine in actor:
        assert ops(engine)[-1] == "release_memory_occupation" and engine.state()["paused"]
    assert all(server.fleet.serves(r, S.RELEASED) for r in server.groups[1].records)
    await close(*actor, *reward)


async def test_a_release_one_engine_would_refuse_runs_no_hook_and_sends_nothing() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.pause()
    seen: list[str] = []
    server.on("before_release", lambda event: seen.append(event.event))
    server.groups[0].records[1].flushed = False  # not idle since its pause, as far as we know
    with pytest.raises(IllegalEngineOp, match="actor/1"):
        await server.offload()
    assert seen == [] and server.state is S.DRAINED
    assert all("release_memory_occupation" not in ops(e) for e in engines)
    await close(*engines)


async def test_the_restores_resume_only_the_tags_released() -> None:
    engines = sims(2)
    config = LifecycleConfig(release_tags=[Tag.KV_CACHE])
    server = RolloutServer([EngineGroup("actor", engines)], config)
    seen: list[str] = []
    for event in ("before_resume_weights", "before_resume_kv"):
        server.on(event, lambda e: seen.append(e.event))
    await server.offload()
    assert all(e.state()["released_tags"] == ["kv_cache"] for e in engines)
    await server.onload_weights()  # no weight tag released: nothing to resume, the hook runs
    assert server.state is S.WEIGHTS_RESTORED and seen == ["before_resume_weights"]
    assert all("resume_memory_occupation" not in ops(e) for e in engines)
    await server.onload_kv()
    assert server.state is S.SERVING and seen == ["before_resume_weights", "before_resume_kv"]
    for engine in engines:
        resumes = [
            e["tags"]
            for e in calls_received(engine.history())
            if e["op"] == "resume_memory_occupation"
        ]
        assert resumes == [["kv_cache"]] and engine.state()["released_tags"] == []
    await close(*engines)
