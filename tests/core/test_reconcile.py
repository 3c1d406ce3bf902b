"""The reconciler: from any settled fleet to any goal state, only the commands that close the
gap, in the lifecycle's order; nothing when nothing is out of place; and no release behind an
engine that was not drained.

Each fleet has a group that offloads and one that keeps its memory, simulated engines whose own
state (paused, released tags) is read back and compared with the records and the goal's targets.
"""

from __future__ import annotations

from typing import Any

import pytest

from rollout_lifecycle import (
    EngineGroup,
    IllegalEngineOp,
    LifecycleConfig,
    PhaseFailed,
    RolloutServer,
    SimulatedEngine,
)
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.outcome import Outcome
from rollout_lifecycle.core.ledger import SETTLED_STATES
from rollout_lifecycle.core.states import Phase, ServerState
from rollout_lifecycle.testing.faults import FaultyEngine
from rollout_lifecycle.testing.fleets import ROUTES, bring_to, received_changes

S = ServerState


def two_group_server_and_engines(wrap: bool = False) -> tuple[RolloutServer, list[Any]]:
    engines: list[Any] = [
        SimulatedEngine(f"{name}-{i}", token_latency=0.001)
        for name in ("actor", "reward")
        for i in range(2)
    ]
    if wrap:
        engines = [FaultyEngine(e) for e in engines]
    groups = [
        EngineGroup("actor", engines[:2]),
        EngineGroup("reward", engines[2:], needs_offload=False),
    ]
    return RolloutServer(groups, LifecycleConfig()), engines


def lifecycle_ops(engine: Any) -> list[str]:
    return [str(e["op"]) for e in engine.history() if e["op"] != "generate"]


@pytest.mark.parametrize("goal", SETTLED_STATES)
@pytest.mark.parametrize("start", list(ROUTES))
async def test_any_settled_fleet_is_brought_to_any_goal(
    start: ServerState, goal: ServerState
) -> None:
    server, engines = two_group_server_and_engines()
    await bring_to(server, start)
    assert server.state is start
    reconciler = server._phases.reconciler
    before = [len(lifecycle_ops(e)) for e in engines]
    outcomes = await reconciler.reconcile(goal, server.fleet.live())
    assert all(o.ok for o in outcomes.values()), outcomes
    for record, engine in zip(server.fleet.records(), engines, strict=True):
        goal_of = server.fleet.target(record, goal)
        assert goal_of is not None
        state = engine.state()
        # the records say what the engines show, and that is the goal's target
        assert set(state["released_tags"]) == {t.value for t in record.released}, record.id
        assert state["paused"] == record.paused, record.id
        assert record.released == set(goal_of.released), (record.id, goal)
        # held out of serving: paused; let generate: not paused (a group that keeps its memory
        # in ``drained`` may be either, as ``pause()`` or ``offload()`` left it)
        if goal_of.held:
            assert record.paused, (record.id, goal)
        if not goal_of.paused:
            assert not record.paused, (record.id, goal)
    implied = S.DRAINED if goal is S.KV_RESTORED else goal
    assert server.fleet.settled_state() is implied
    # nothing was sent to an engine already at its target, and a second pass sends nothing
    if start is goal:
        assert [len(lifecycle_ops(e)) for e in engines] == before
    assert await reconciler.reconcile(goal, server.fleet.live()) == {}
    for engine in engines:
        await engine.close()


async def test_no_release_follows_a_flush_that_failed_and_the_continue_is_per_engine() -> None:
    """Toward ``released`` from ``serving``: the flush is refused by one offloaded engine, so
    no engine is released (not even the one that flushed); the phases after that one stop."""
    server, engines = two_group_server_and_engines(wrap=True)
    engines[1].arm("flush_cache", "reject")
    outcomes = await server._phases.reconciler.reconcile(S.RELEASED, server.fleet.live())
    assert outcomes["actor/1"].outcome is Outcome.REJECTED
    assert outcomes["actor/0"].ok
    assert not any("release_memory_occupation" in lifecycle_ops(e) for e in engines)
    assert all(not r.released for r in server.fleet.records())
    # the group that keeps its memory was never paused: it serves in ``released``
    assert not any(r.paused for r in server.fleet.records() if r.group == "reward")
    for engine in engines:
        await engine.close()


async def test_a_stale_replacement_is_paused_wherever_it_is_and_not_continued() -> None:
    """A fresh server without the fleet's weights waits paused, even in a serving fleet."""
    server, engines = two_group_server_and_engines()
    record = server.fleet.records()[2]  # a group that keeps its memory: serving everywhere
    record.stale = True
    outcomes = await server._phases.reconciler.reconcile(S.SERVING, server.fleet.live())
    assert set(outcomes) == {record.id}
    assert record.paused and record.flushed
    assert engines[2].state()["paused"]
    assert lifecycle_ops(engines[2])[-2:] == ["pause_generation", "flush_cache"]
    for engine in engines:
        await engine.close()


async def test_an_engine_reporting_other_weights_is_not_continued_and_waits_stale() -> None:
    """Toward ``serving`` with a versioned update expected (a push that failed part-way set
    ``v2``): the engine that reports ``v2`` is continued; the one that reports other weights
    is left paused and marked stale (it waits for an update, as a replacement does), so the
    records settle as ``serving`` and no engine serves weights the trainer did not push."""
    server, engines = two_group_server_and_engines()
    await server.pause()
    server._versions.expected = "v2"
    await engines[0].update_weight_version("v2", abort_all_requests=False)
    for engine in engines[2:]:
        await engine.update_weight_version("v2", abort_all_requests=False)
    outcomes = await server._phases.reconciler.reconcile(S.SERVING, server.fleet.live())
    assert outcomes["actor/0"].ok and "actor/1" not in outcomes
    actor0, actor1 = server.fleet.records()[:2]
    assert not actor0.paused and not actor0.stale
    assert actor1.paused and actor1.stale and engines[1].state()["paused"]
    assert server.fleet.settled_state() is S.SERVING
    assert not server.fleet.serves(actor1, S.SERVING)
    for engine in engines:
        await engine.close()


async def test_an_engine_waiting_for_the_weights_is_continued_once_it_reports_them() -> None:
    """Toward ``serving`` with ``v2`` expected: an engine waiting for the weights (stale,
    paused) that now reports ``v2`` holds them and is continued; one that reports ``v2`` but
    failed the last write's verification is not read and waits for a write."""
    server, engines = two_group_server_and_engines()
    await server.pause()
    server._versions.expected = "v2"
    for engine in engines:
        await engine.update_weight_version("v2", abort_all_requests=False)
    waiting, unverified = server.fleet.records()[1], server.fleet.records()[3]
    waiting.lacks_weights()
    unverified.failed_verification()
    outcomes = await server._phases.reconciler.reconcile(S.SERVING, server.fleet.live())
    assert sorted(outcomes) == ["actor/0", "actor/1", "reward/0"]
    assert not waiting.stale and not waiting.paused and not engines[1].state()["paused"]
    assert unverified.stale and unverified.paused and engines[3].state()["paused"]
    assert "weight_version" not in lifecycle_ops(engines[3])
    for engine in engines:
        await engine.close()


async def test_a_reconciliation_takes_only_the_steps_its_phases_name() -> None:
    """Toward ``released`` from ``serving`` with only the pause named: the engines that
    offload are paused, nothing is flushed or released. With the flush named too and refused
    by one engine, ``require`` raises under the flush's name."""
    server, engines = two_group_server_and_engines(wrap=True)
    reconciler = server._phases.reconciler
    live = server.fleet.live()
    outcomes = await reconciler.reconcile(S.RELEASED, live, {Op.PAUSE: Phase.PAUSE_FOR_UPDATE})
    assert sorted(outcomes) == ["actor/0", "actor/1"]
    assert [received_changes(e) for e in engines] == [["pause_generation"]] * 2 + [[]] * 2
    engines[1].arm("flush_cache", "reject")
    phases = {Op.PAUSE: Phase.PAUSE, Op.FLUSH: Phase.FLUSH, Op.RELEASE: Phase.RELEASE}
    with pytest.raises(PhaseFailed) as failed:
        await reconciler.require(S.RELEASED, live, phases)
    assert failed.value.phase is Phase.FLUSH
    assert not any("release_memory_occupation" in lifecycle_ops(e) for e in engines)
    for engine in engines:
        await engine.close()


async def test_a_forward_step_refuses_before_its_hooks_where_recovery_repairs() -> None:
    """The same engine out of place (paused, not flushed since): the forward release
    (``advance``) refuses the whole step before its ``before_release`` hooks and sends nothing;
    the recovery pass (``reconcile``) flushes that engine, then releases the group."""
    server, engines = two_group_server_and_engines()
    await server.pause()
    actor = server.fleet.groups[0]
    unflushed = actor.records[0]
    unflushed.flushed = False
    hooked: list[str] = []
    server.on("before_release", lambda event: hooked.append(event.event))
    reconciler = server._phases.reconciler
    with pytest.raises(IllegalEngineOp, match=r"actor/0.*has not passed a flush"):
        await reconciler.advance(S.DRAINED, S.RELEASED, [actor], Op.RELEASE, "release")
    assert hooked == []
    assert not any("release_memory_occupation" in lifecycle_ops(e) for e in engines)
    outcomes = await reconciler.reconcile(S.RELEASED, list(actor.records))
    assert all(o.ok for o in outcomes.values()), outcomes
    memory = [[op for op in lifecycle_ops(e) if op != "observe"] for e in engines[:2]]
    assert memory[0][-2:] == ["flush_cache", "release_memory_occupation"]
    assert memory[1][-2:] == ["flush_cache", "release_memory_occupation"]
    assert all(r.released for r in actor.records)
    for engine in engines:
        await engine.close()


async def test_a_forward_step_runs_its_hooks_then_sends_what_the_goal_needs() -> None:
    """A forward step runs its ``before_`` hook first, then sends its command to the engines
    the goal needs it on, and fails under its own name: a drain's pause skips an engine the
    records know to be paused, and a refused flush raises ``PhaseFailed('flush')``."""
    server, engines = two_group_server_and_engines(wrap=True)
    reconciler = server._phases.reconciler
    order: list[str] = []
    server.on("before_pause", lambda event: order.append(f"hook {event.event}"))
    already = server.fleet.records()[2]
    await engines[2].pause_generation("retract")
    already.paused = True
    groups = server.fleet.groups
    await reconciler.advance(S.SERVING, S.DRAINED, groups, Op.PAUSE, "pause")
    assert order == ["hook before_pause"]
    assert [lifecycle_ops(e).count("pause_generation") for e in engines] == [1, 1, 1, 1]
    assert all(r.paused for r in server.fleet.records())
    engines[1].arm("flush_cache", "reject")
    with pytest.raises(PhaseFailed) as failed:
        await reconciler.advance(S.SERVING, S.DRAINED, groups, Op.FLUSH, "flush")
    assert failed.value.phase == "flush"
    assert failed.value.outcomes["actor/1"].outcome is Outcome.REJECTED
    for engine in engines:
        await engine.close()
