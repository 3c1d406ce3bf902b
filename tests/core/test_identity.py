"""Engine identity: a process restarted at an engine's place, an engine another controller drives,
and a replacement that is the old process handed back are never acted on as the records say;
the records learn what the engines show, and the server's state follows from them."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import rollout_lifecycle
from rollout_lifecycle import (
    Deadlines,
    EngineGroup,
    IllegalTransition,
    LifecycleConfig,
    LifecycleEvent,
    Outcome,
    PhaseFailed,
    RolloutServer,
    ServerState,
    SimulatedEngine,
)
from rollout_lifecycle.backends.engine import EngineHost, incarnation_of
from rollout_lifecycle.contract.identity import PROOF_WINDOW
from rollout_lifecycle.testing import calls_received, until
from rollout_lifecycle.testing.faults import FaultyEngine
from rollout_lifecycle.testing.fleets import no_push
from rollout_lifecycle.testing.fleets import simulated_engines as sims

S = ServerState
#: An outer bound on every call a regression could hang.
BOUND = 30.0
CONFIG = LifecycleConfig(deadlines=Deadlines(pause=5, flush=5, release=5, resume=5, probe=5))


def engine_of(record_engine: Any) -> SimulatedEngine:
    inner = record_engine.backend if isinstance(record_engine, EngineHost) else record_engine
    inner = inner.inner if isinstance(inner, FaultyEngine) else inner
    assert isinstance(inner, SimulatedEngine)
    return inner


def assert_records_match(server: RolloutServer) -> None:
    """Every record says what its engine reports of itself (paused, released tags, alive,
    incarnation), unless the record says it does not know."""
    for engine_id, handle in server.engines().items():
        sim = engine_of(handle)
        record = server.snapshot().engines()[engine_id]
        assert record.alive == (not sim.dead), engine_id
        if not record.pause_unknown:
            assert record.paused == sim.paused, engine_id
        if not record.uncertain:
            assert list(record.released) == sim.released_tags, engine_id
        assert record.incarnation in (None, sim_incarnation(sim)), engine_id


def sim_incarnation(sim: SimulatedEngine) -> str | None:
    return incarnation_of(
        {"startup_time": sim._state.startup_time(), "random_seed": sim._state.random_seed}
    )


async def full_cycle(server: RolloutServer, version: str) -> None:
    await server.offload()
    await server.onload_weights()
    await server.update_weights(no_push, version=version)
    await server.onload_kv()


async def bring_back(server: RolloutServer, engines: list[SimulatedEngine]) -> None:
    """What a user does after the failure: recover, then a cycle that pushes weights to all."""
    await asyncio.wait_for(server.recover(lambda engine_id: SimulatedEngine("unused")), BOUND)
    assert server.state is not S.FAILED
    assert_records_match(server)
    if server.state is S.SERVING:
        await server.pause()
        await server.update_weights(no_push, version="after")
        await server.resume()
    await full_cycle(server, "next")
    assert server.state is S.SERVING
    assert not any(e.dead for e in engines)
    assert all(not e.paused and e.released_tags == [] for e in engines)
    assert not any(r.stale for r in server.snapshot().engines().values())


# -- a process restarted at an engine's place, at every boundary of a cycle ----------------------


def once(action: Callable[[], Awaitable[Any]]) -> Callable[[LifecycleEvent], Awaitable[None]]:
    """A hook that runs ``action`` the first time its event fires (a restart, say)."""
    done = False

    async def hook(event: LifecycleEvent) -> None:
        nonlocal done
        if not done:
            done = True
            await action()

    return hook


@pytest.mark.parametrize(
    ("boundary", "phase"),
    [
        ("before_flush", "release"),  # after the pause
        ("before_release", "release"),  # after the flush
    ],
)
async def test_a_restart_inside_an_offload_is_found_before_the_release(
    boundary: str, phase: str
) -> None:
    engines = sims(3)
    server = RolloutServer([EngineGroup("actor", engines)], CONFIG)
    await full_cycle(server, "v1")
    old = server.snapshot().engines()["actor/0"].incarnation
    assert old == sim_incarnation(engines[0])
    server.on(boundary, once(engines[0].restart))
    with pytest.raises(PhaseFailed) as err:
        await asyncio.wait_for(server.offload(), BOUND)
    assert err.value.phase == phase and err.value.failed_engines == ["actor/0"]
    outcome = err.value.outcomes["actor/0"]
    assert outcome.outcome is Outcome.RESTARTED and old in outcome.detail
    assert server.state is S.FAILED
    record = server.snapshot().engines()["actor/0"]
    # The record describes the fresh server: serving, everything resident, stale
    assert (record.paused, record.released, record.stale) == (False, (), True)
    assert record.incarnation == sim_incarnation(engines[0]) != old
    assert_records_match(server)
    # nothing was sent to the new process but the reads that found it
    after = [c for c in engines[0].history() if c["start"] > restart_time(engines[0])]
    assert {c["op"] for c in calls_received(after)} <= {"flush_cache", "release_memory_occupation"}
    assert not any(c["op"] == "release_memory_occupation" and "check_of" not in c for c in after)
    await bring_back(server, engines)


def restart_time(engine: SimulatedEngine) -> float:
    return max(c["start"] for c in engine.history() if c["op"] == "restart")


async def test_a_restart_between_offload_and_onload_kills_nothing() -> None:
    """The resume of the weights would kill a fresh server (SGLang: KeyError on a tag that is
    not released); it is found restarted instead."""
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)], CONFIG)
    await server.offload()
    await engines[1].restart()
    with pytest.raises(PhaseFailed) as err:
        await server.onload_weights()
    assert err.value.phase == "resume_weights"
    assert err.value.outcomes["actor/1"].outcome is Outcome.RESTARTED
    assert not engines[1].dead and engines[1].released_tags == []
    assert not any(
        c["op"] == "resume_memory_occupation" and "check_of" not in c
        for c in engines[1].history()
        if c["start"] > restart_time(engines[1])
    )
    assert server.state is S.FAILED
    assert_records_match(server)
    await bring_back(server, engines)


async def test_a_restart_after_the_weights_stops_the_weight_update_before_its_session() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)], CONFIG)
    await server.offload()
    await server.onload_weights()
    await engines[0].restart()
    with pytest.raises(PhaseFailed) as err:
        await server.update_weights(no_push, version="v1")
    assert err.value.phase == "begin_weight_update"
    assert err.value.outcomes["actor/0"].outcome is Outcome.RESTARTED
    # the other engine's session was closed, and nobody was labelled with the version
    assert not engines[1].weight_update_session_open
    assert [await e.weight_version() for e in engines] == ["default", "default"]
    assert_records_match(server)
    await bring_back(server, engines)


async def test_a_restart_after_the_kv_cache_is_found_by_the_continue() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)], CONFIG)
    server.on("before_continue", once(engines[0].restart))
    await server.offload()
    await server.onload_weights()
    await server.update_weights(no_push, version="v1")
    with pytest.raises(PhaseFailed) as err:
        await server.onload_kv()
    assert err.value.phase == "continue"
    assert err.value.outcomes["actor/0"].outcome is Outcome.RESTARTED
    record = server.snapshot().engines()["actor/0"]
    assert record.stale and not record.paused  # a fresh server, serving its initial weights
    assert server.state is S.FAILED  # never 'serving' over an engine without the weights
    assert_records_match(server)
    await bring_back(server, engines)


async def test_a_probe_finds_a_restart_and_the_server_leaves_serving() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)], CONFIG)
    await full_cycle(server, "v1")
    await engines[1].restart()
    outcomes = await server.probe()
    assert outcomes["actor/1"].outcome is Outcome.RESTARTED
    assert outcomes["actor/0"].ok
    assert server.state is S.FAILED
    assert server.snapshot().engines()["actor/1"].stale
    assert_records_match(server)
    await bring_back(server, engines)


@pytest.mark.looptime
async def test_a_dropped_release_on_a_restarting_server_is_a_fresh_server_not_an_unknown() -> None:
    """The connection of a release drops because the server restarted under it: the engine is
    read at once, and its record describes the new process (no tag is left uncertain, so no
    replacement is needed)."""
    # (the release outlasts the restart, which comes PROOF_WINDOW after its send at the soonest)
    latency = {"release_memory_occupation": PROOF_WINDOW + 2}
    engines = [SimulatedEngine(f"e{i}", token_latency=0.001, op_latency=latency) for i in range(2)]
    server = RolloutServer([EngineGroup("actor", engines)], CONFIG)
    offload = asyncio.ensure_future(server.offload())
    # waits on a fact: the release is in flight on the engine
    await until(lambda: "release_memory_occupation" in engines[0].state()["in_flight"])
    await engines[0].restart()
    with pytest.raises(PhaseFailed) as err:
        await asyncio.wait_for(offload, BOUND)
    outcome = err.value.outcomes["actor/0"]
    assert outcome.outcome is Outcome.RESTARTED and "dropped" in outcome.detail
    record = server.snapshot().engines()["actor/0"]
    assert record.uncertain == () and record.stale and record.alive
    assert_records_match(server)
    await bring_back(server, engines)


# -- another controller ------------------------------------------------------------------------


@pytest.mark.looptime
async def test_an_engine_another_controller_continued_is_not_released_or_resumed() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)], CONFIG)
    await server.offload()
    await engines[0].continue_generation()  # someone else continues it, memory released
    # (by hand, outside any claim: seen once the last answer no longer proves the engine; a
    # server of this process acting on it is seen at once, test_claims_between_controllers)
    await asyncio.sleep(PROOF_WINDOW)  # virtual time
    with pytest.raises(PhaseFailed) as err:
        await server.onload_weights()
    outcome = err.value.outcomes["actor/0"]
    assert outcome.outcome is Outcome.CONFLICT
    assert "records hold it paused" in outcome.detail and "reports serving" in outcome.detail
    assert engines[0].released_tags != []  # nothing was resumed behind its back
    record = server.snapshot().engines()["actor/0"]
    # who drives it, and what memory it holds, is not known: nothing more is sent to it
    assert record.pause_unknown and set(record.uncertain) == {"weights", "kv_cache", "cuda_graph"}
    assert server.state is S.FAILED
    assert not any(e.dead for e in engines)
    # restarted in place, it is a fresh server that recover() brings in
    await engines[0].restart()
    await server.recover(lambda engine_id: server.engines()[engine_id])
    # (the other engine's weights came back in the failed resume; on a tie the fleet goes
    # with the most restored)
    assert server.state is S.WEIGHTS_RESTORED
    assert_records_match(server)
    await server.update_weights(no_push, version="v1")  # the restarted one has initial weights
    await server.onload_kv()
    assert server.state is S.SERVING and not any(e.dead for e in engines)


async def test_a_probe_finds_an_engine_paused_behind_the_servers_back() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)], CONFIG)
    await engines[1].pause_generation("retract")
    outcomes = await server.probe()
    assert outcomes["actor/1"].outcome is Outcome.CONFLICT
    assert server.state is S.FAILED  # requests routed to it would wait in its front end
    assert server.snapshot().engines()["actor/1"].uncertain  # (what else was done to it?)
    replacement = SimulatedEngine("e1-new", token_latency=0.001)
    await server.recover(lambda engine_id: replacement)
    assert server.state is S.SERVING and not replacement.dead


async def test_a_server_that_finds_its_engines_left_paused_by_another_sends_no_release() -> None:
    """A second controller with its own records (serving) meets engines the first offloaded:
    its pause finds them paused, and nothing more is sent (a second release would kill)."""
    engines = sims(2)
    first = RolloutServer([EngineGroup("actor", engines)], CONFIG, name="first")
    await first.offload()
    second = RolloutServer([EngineGroup("actor", engines)], CONFIG, name="second")
    with pytest.raises(PhaseFailed) as err:
        await second.offload()
    assert err.value.phase == "pause"
    assert {o.outcome for o in err.value.outcomes.values()} == {Outcome.CONFLICT}
    assert not any(e.dead for e in engines)
    # the first controller's records still describe the engines: it carries on
    await first.onload()
    assert first.state is S.SERVING and not any(e.paused for e in engines)


# -- recover() checks what the factory hands back --------------------------------------------------


async def test_recover_given_the_same_unrestarted_engine_keeps_its_record_and_fails() -> None:
    faulty = [FaultyEngine(e) for e in sims(2)]
    server = RolloutServer([EngineGroup("actor", faulty)], CONFIG)
    faulty[0].arm("release_memory_occupation", "drop_after")  # landed, the answer lost
    with pytest.raises(PhaseFailed):
        await server.offload()
    before = server.snapshot().engines()["actor/0"]
    assert before.uncertain  # the release may or may not have landed
    with pytest.raises(PhaseFailed, match="handed back the process") as err:
        await server.recover(lambda engine_id: faulty[0])  # the same process, not restarted
    assert err.value.outcomes["actor/0"].outcome is Outcome.REFUSED
    after = server.snapshot().engines()["actor/0"]
    assert (after.uncertain, after.paused, after.incarnation) == (
        before.uncertain,
        before.paused,
        before.incarnation,
    )
    assert server.state is S.FAILED  # never 'serving' over a paused, released engine
    assert engine_of(faulty[0]).paused and engine_of(faulty[0]).released_tags
    assert not engine_of(faulty[0]).dead


async def test_recover_given_the_same_engine_restarted_takes_it_as_fresh() -> None:
    faulty = [FaultyEngine(e) for e in sims(2)]
    server = RolloutServer([EngineGroup("actor", faulty)], CONFIG)
    faulty[0].arm("release_memory_occupation", "drop_after")
    with pytest.raises(PhaseFailed):
        await server.offload()
    await engine_of(faulty[0]).restart()

    await server.recover(lambda engine_id: faulty[0])
    assert server.state is S.RELEASED
    assert_records_match(server)
    await server.onload_weights()
    await server.update_weights(no_push, version="v1")
    await server.onload_kv()
    assert server.state is S.SERVING and not any(engine_of(f).dead for f in faulty)


async def test_recover_refuses_a_replacement_that_reports_itself_paused() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)], CONFIG)
    await engines[0].close()  # dies
    await server.probe()
    used = SimulatedEngine("paused-elsewhere")
    await used.pause_generation("retract")
    with pytest.raises(PhaseFailed, match="not a fresh server") as err:
        await server.recover(lambda engine_id: used)
    assert err.value.outcomes["actor/0"].outcome is Outcome.CONFLICT
    record = server.snapshot().engines()["actor/0"]
    assert record.uncertain  # its memory cannot be read: the factory replaces it again
    await server.recover(lambda engine_id: SimulatedEngine("fresh"))
    assert server.state is S.SERVING


async def test_reset_names_why_the_records_settle_in_no_state() -> None:
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)], CONFIG)
    await server.offload()
    await engines[0].restart()
    with pytest.raises(PhaseFailed):
        await server.onload_weights()
    with pytest.raises(IllegalTransition) as err:
        await server.reset()
    message = str(err.value)
    assert "allowed from" not in message
    assert "actor/0 is a fresh server without the fleet's weights that is not paused" in message
    assert "recover() brings them to one" in message


async def test_the_library_keeps_nothing_per_cycle() -> None:
    """Over hundreds of cycles the library's own memory stays flat (the timeline keeps its last
    calls, the records their facts). What does grow in a long in-process run is the simulator's
    history, which keeps every call for tests by design: ``take_history()`` each round drops it."""
    engines = sims(2)
    server = RolloutServer([EngineGroup("actor", engines)], CONFIG)

    async def cycles(n: int) -> None:
        for i in range(n):
            await full_cycle(server, f"v{i}")
            for engine in engines:
                engine.take_history()

    core = [tracemalloc.Filter(True, f"{Path(rollout_lifecycle.__file__).parent / 'core'}*")]
    await cycles(50)  # warm: caches, the timeline's window, the loop's free lists
    tracemalloc.start()
    try:
        await cycles(10)
        gc.collect()  # what is kept, not garbage a collection has yet to reach
        before = tracemalloc.take_snapshot().filter_traces(core)
        await cycles(200)
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(core)
    finally:
        tracemalloc.stop()
    grown = sum(d.size_diff for d in after.compare_to(before, "filename"))
    assert grown < 64 * 1024, after.compare_to(before, "lineno")[:5]
