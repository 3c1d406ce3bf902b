"""The phase runner's guards: all or nothing across groups, the journal before the send, the
default targets and guards of each operation, and a call that outlives its phase."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

import pytest

from rollout_lifecycle import (
    EngineGroup,
    IllegalEngineOp,
    PauseMode,
    RolloutServer,
    SimulatedEngine,
    Tag,
)
from rollout_lifecycle.backends.engine import incarnation_of
from rollout_lifecycle.contract.commands import (
    Continue,
    EngineCommand,
    Pause,
    ReadServerInfo,
    Release,
    Resume,
    SetVersion,
)
from rollout_lifecycle.contract.exceptions import PhaseFailed
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.outcome import Outcome
from rollout_lifecycle.core.bus import Bus, RecordsChanged
from rollout_lifecycle.core.config import DeadEnginePolicy, LifecycleConfig
from rollout_lifecycle.core.ledger import EngineRecord, default_targets
from rollout_lifecycle.core.runner import (
    Calls,
    PhaseResult,
    PhaseRunner,
    PhaseSettled,
    Plan,
    WorkerUrls,
    issue,
)
from rollout_lifecycle.testing import calls_received
from rollout_lifecycle.testing.fleets import simulated_engines as sims


def lifecycle_ops(engine: SimulatedEngine) -> list[str]:
    return [str(entry["op"]) for entry in engine.history() if entry["op"] != "generate"]


async def drained(server: RolloutServer) -> None:
    await server.pause()
    assert all(r.paused and r.flushed for g in server.groups for r in g.records)


async def test_a_call_planned_over_two_groups_where_one_is_refused_sends_nothing() -> None:
    first, second = sims(2, "a"), sims(2, "b")
    server = RolloutServer([EngineGroup("a", first), EngineGroup("b", second)])
    await drained(server)
    before = {e.label: lifecycle_ops(e) for e in first + second}
    refused = server.groups[1].records[1]
    refused.flushed = False  # not passed the idle barrier: its release is refused
    plan = Plan.over(server.groups, Release((Tag.KV_CACHE,)))
    journal: list[int] = []
    with pytest.raises(IllegalEngineOp, match="b/1"):
        issue(plan, lambda: journal.append(1))
    # nothing was sent to any engine of either group, and the ledger is as it was
    assert {e.label: lifecycle_ops(e) for e in first + second} == before
    assert not any(r.uncertain or r.released for g in server.groups for r in g.records)
    assert journal == []
    for engine in first + second:
        await engine.close()


async def test_a_journal_that_raises_sends_nothing_and_leaves_no_intent() -> None:
    engines = sims(2, "a")
    server = RolloutServer([EngineGroup("a", engines)])
    await drained(server)
    before = [lifecycle_ops(e) for e in engines]

    def journal() -> None:
        raise OSError("disk full")

    plan = Plan.over(server.groups, Release((Tag.KV_CACHE,)))
    with pytest.raises(OSError, match="disk full"):
        issue(plan, journal)
    assert [lifecycle_ops(e) for e in engines] == before
    assert not any(r.uncertain for r in server.groups[0].records)
    for engine in engines:
        await engine.close()


async def test_a_phase_shares_one_intent_per_value_and_each_engine_gets_its_own_back() -> None:
    # A phase puts an intent in every target's record; a fleet of thousands in flight must
    # not hold one object per engine for the collector to walk, so equal intents are one.
    engines = sims(6, "a")
    server = RolloutServer([EngineGroup("a", engines)])
    records = server.groups[0].records
    records[0].pause_unknown = True  # its last pause did not answer: another value to keep
    held: list[set[int]] = []

    def journal() -> None:
        held.append({id(r._intent) for r in records[1:]})
        held.append({id(records[0]._intent)})
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        issue(Plan.over(server.groups, Pause(PauseMode.RETRACT)), journal)
    assert len(held[0]) == 1 and held[0] != held[1]
    # undone, each record holds what it held before the intent
    assert records[0].pause_unknown and not records[0].paused
    assert not any(r.paused or r.pause_unknown for r in records[1:])
    assert not any(lifecycle_ops(e) for e in engines)
    for engine in engines:
        await engine.close()


def test_the_default_targets_of_each_operation() -> None:
    offloads = EngineGroup("a", sims(3, "a"))
    keeps = EngineGroup("k", sims(1, "k"), needs_offload=False)
    a0, a1, a2 = offloads.records
    a1.paused, a1.pause_mode = True, PauseMode.RETRACT
    a2.alive = False
    assert default_targets(offloads, Op.RELEASE) == [a0, a1]
    assert default_targets(keeps, Op.RELEASE) == []
    assert default_targets(keeps, Op.RESUME) == []
    assert default_targets(offloads, Op.CONTINUE) == [a1]
    assert default_targets(offloads, Op.FLUSH) == [a1]
    assert default_targets(offloads, Op.PAUSE) == [a0, a1]
    assert default_targets(offloads, Op.BEGIN_UPDATE) == [a0, a1]


def test_each_operation_has_its_guard() -> None:
    group = EngineGroup("a", sims(1, "a"))
    (record,) = group.records
    with pytest.raises(IllegalEngineOp, match="not paused"):
        Plan(Release((Tag.KV_CACHE,)), (record,)).check()
    with pytest.raises(IllegalEngineOp, match="not released"):
        Plan(Resume((Tag.KV_CACHE,)), (record,)).check()
    record.released.add(Tag.WEIGHTS)
    with pytest.raises(IllegalEngineOp, match="released"):
        Plan(Continue(), (record,)).check()
    with pytest.raises(IllegalEngineOp, match="weights are released"):
        Plan(SetVersion("v1"), (record,)).check()
    record.alive = False
    with pytest.raises(IllegalEngineOp, match="dead"):
        Plan(ReadServerInfo(), (record,)).check()


async def test_a_call_that_missed_its_deadline_is_the_engines_until_it_lands() -> None:
    """What an engine is busy with is a property of its record: a pause that outlived its phase
    holds back a continue (it would land after it) but not a read or another pause, and once it
    lands the engine is free."""
    (engine,) = [SimulatedEngine("slow", token_latency=0.001, op_latency={"pause_generation": 0.3})]
    group = EngineGroup("a", [engine])
    (record,) = group.records
    runner = PhaseRunner("s", DeadEnginePolicy.FAIL, Bus())
    plan = Plan(Pause(PauseMode.ABORT), (record,))
    result = await runner.run("pause", plan, 0.05)
    assert result.outcomes["a/0"].outcome is Outcome.TIMED_OUT
    assert record.in_flight is not None and record.in_flight.op is Op.PAUSE
    assert record.busy_for(Op.CONTINUE) and record.busy_for(Op.RELEASE)
    assert not record.busy_for(Op.PAUSE) and not record.busy_for(Op.SERVER_INFO)
    # a phase the late call matters to waits for it (here: until it lands)
    assert await runner.landed([record], 30.0, Op.CONTINUE) == [record]
    assert record.in_flight is None
    assert not record.busy_for(Op.CONTINUE)
    await engine.close()


class Addressed(SimulatedEngine):
    """A simulated engine with a worker URL."""

    def __init__(self, label: str) -> None:
        super().__init__(label, token_latency=0.001)
        self.url = f"http://{label}.test:1"


class CountingRunner(PhaseRunner):
    """A phase runner that logs the reads it is asked to send."""

    def __init__(self) -> None:
        super().__init__("s", DeadEnginePolicy.FAIL, Bus())
        self.asked: list[tuple[Op, list[str]]] = []

    async def ask(
        self, command: EngineCommand, records: Sequence[EngineRecord], deadline: float
    ) -> dict[str, Any]:
        self.asked.append((command.op, [r.id for r in records]))
        return await super().ask(command, records, deadline)


async def test_a_read_beside_the_lifecycle_is_sent_through_the_runner_and_records_nothing() -> None:
    """``ask`` (the router binding's worker URLs, the memory metrics): the answers of the
    engines within the deadline; a dead or slow engine is left out, a late call is not kept,
    no record or phase event changes, and only reads may be sent this way."""
    fast, slow, dead = (
        SimulatedEngine("fast", token_latency=0.001),
        SimulatedEngine("slow", token_latency=0.001, op_latency={"server_info": 30.0}),
        SimulatedEngine("dead", token_latency=0.001),
    )
    group = EngineGroup("a", [fast, slow, dead])
    records = group.records
    dead._die("killed for the test")
    records[2].alive = False
    bus, events = Bus(), []
    bus.subscribe(PhaseSettled, events.append)
    bus.subscribe(RecordsChanged, events.append)
    runner = PhaseRunner("s", DeadEnginePolicy.FAIL, bus)
    answers = await runner.ask(ReadServerInfo(), records, 0.2)
    assert set(answers) == {"a/0"} and isinstance(answers["a/0"], dict)
    assert events == []
    assert all(r.last_op is None and r.in_flight is None for r in records)
    with pytest.raises(ValueError, match="pause_generation"):
        await runner.ask(Pause(PauseMode.ABORT), records, 0.2)
    for engine in (fast, slow, dead):
        await engine.close()


async def test_each_engines_worker_url_is_asked_once() -> None:
    engines = [Addressed("e0"), Addressed("e1")]
    group = EngineGroup("a", engines)
    runner = CountingRunner()
    urls = WorkerUrls(runner, 5.0)
    # recorded dead, its in-process host still answers: its address stays this server's
    group.records[1].alive = False
    expected = {"a/0": "http://e0.test:1", "a/1": "http://e1.test:1"}
    assert await urls.of(group.records) == expected
    assert await urls.of(group.records[1:]) == {"a/1": expected["a/1"]}
    assert runner.asked == [(Op.WORKER_URL, ["a/0", "a/1"])]
    # a replacement is another engine: asked anew
    replacement = Addressed("e2")
    group.replace(group.records[0], replacement)
    assert (await urls.of(group.records))["a/0"] == "http://e2.test:1"
    assert runner.asked[1:] == [(Op.WORKER_URL, ["a/0"])]
    for engine in [*engines, replacement]:
        await engine.close()


async def test_a_batch_of_calls_keeps_each_call_with_its_engine_in_order() -> None:
    engines = [SimulatedEngine(f"sim-{i}") for i in range(5)]
    actor, critic = EngineGroup("actor", engines[:3]), EngineGroup("critic", engines[3:])
    calls = Calls.join([actor.pause_generation(PauseMode.RETRACT), critic.probe(), actor.probe()])
    assert len(calls) == 8
    views = list(calls)
    ids = ["actor/0", "actor/1", "actor/2", "critic/0", "critic/1", "actor/0", "actor/1", "actor/2"]
    assert [c.record.id for c in views] == ids
    assert [c.op for c in views] == ["pause_generation"] * 3 + ["server_info"] * 5
    assert [c.mode for c in views] == [PauseMode.RETRACT] * 3 + [None] * 5
    assert [c.start for c in views] == sorted(c.start for c in views)
    answers = await asyncio.gather(*(c.ref for c in views))
    # each ref is its own engine's answer
    labels = ["sim-0", "sim-1", "sim-2", "sim-3", "sim-4", "sim-0", "sim-1", "sim-2"]
    # /server_info names no engine; the simulator's model path does.
    paths = [a["model_path"] for a in answers[3:]]
    assert paths == [f"simulated/{x}" for x in labels[3:]]
    # a checked call answers the incarnation the engine showed before it ran (read on the first
    # call to an engine, and then by every call that could kill it), its result, and, read with
    # the incarnation, what the engine's driver declares it can do
    declared = SimulatedEngine.capabilities.to_wire()
    assert answers[:3] == [(incarnation_of(a), None, declared) for a in answers[5:]]
    for engine in engines[:3]:  # the probe came after the pause, which was checked first
        received = calls_received(engine.history())
        assert [c["op"] for c in received] == ["pause_generation", "server_info"]
        assert received[0]["checks"] == ["observe"]
    await asyncio.gather(*(e.close() for e in engines))


async def cycles_of_checked_calls(
    phase: str, cycles: int
) -> tuple[list[SimulatedEngine], RolloutServer, list[PhaseResult]]:
    """``cycles`` full cycles of three engines whose every checked call reads its engine first
    (no answer proves a process past its call); what each ``phase`` came to."""
    engines = [SimulatedEngine(f"sim-{i}", seed=i) for i in range(3)]
    server = RolloutServer([EngineGroup("actor", engines)], config=LifecycleConfig(proof_window=0))
    results: list[PhaseResult] = []
    server.bus.subscribe(
        PhaseSettled, lambda e: results.append(e.result) if e.result.phase == phase else None
    )
    for _ in range(cycles):
        await server.offload()
        await server.onload_weights()
        await server.onload_kv()
    return engines, server, results


async def test_a_check_that_holds_costs_its_phase_no_object_per_engine() -> None:
    """At thousands of in-process engines, every object a phase allocates per engine and keeps
    until it settles brings the collector's next full collection nearer (benchmarks/README.md,
    section 11). A checked call whose check reads the pause state alone (the engine paused, its
    process known) keeps no expectation and no answer of its own: the record gives the same
    expectation while its values hold, and the host one shared answer."""
    engines, server, (first, second) = await cycles_of_checked_calls("release", 2)
    records = server.groups[0].records
    # checked, on the pause state alone
    assert first.calls.expects == [(r.incarnation, True, False) for r in records]
    assert all(isinstance(r.incarnation, str) for r in records)
    # the same expectation, one per engine, in both cycles
    assert all(a is b for a, b in zip(first.calls.expects, second.calls.expects, strict=True))
    # one answer for every engine, and every engine read first
    answers = [ref.result() for ref in first.calls.refs]  # type: ignore[attr-defined]
    # (no incarnation read, nothing declared, and the release's answer: its weights' values
    # were kept)
    assert answers == [(None, False, None)] * 3
    assert all(a is answers[0] for a in answers)
    for engine in engines:
        releases_received = [
            c for c in calls_received(engine.history()) if c["op"] == "release_memory_occupation"
        ]
        assert [c["checks"] for c in releases_received] == [["observe"]] * 2
    # the record, paused again, gives the same one; another process's is another
    record = records[0]
    later = math.inf  # (long after any answer: nothing proves the process)
    record.paused = True
    assert record.expect(Op.RELEASE, later) is second.calls.expects[0]
    record.incarnation = "another process"
    assert record.expect(Op.RELEASE, later) == ("another process", True, False)
    await asyncio.gather(*(e.close() for e in engines))


@pytest.mark.looptime
async def test_a_pause_that_reads_the_incarnation_keeps_no_object_per_engine_either() -> None:
    """The pause after a rollout reads each engine's incarnation (no answer is recent enough to
    prove the process): from the second such pause on, the record gives the expectation it gave
    before, the host the answer it gave before, and the driver's declaration in it is the one
    mapping of its capabilities, not a copy per engine."""
    engines, server, (_, second, third) = await cycles_of_checked_calls("pause", 3)
    records = server.groups[0].records
    assert second.calls.expects == [(r.incarnation, False, True) for r in records]
    assert all(a is b for a, b in zip(second.calls.expects, third.calls.expects, strict=True))
    answers = [[ref.result() for ref in p.calls.refs] for p in (second, third)]  # type: ignore[attr-defined]
    for record, engine, before, after in zip(records, engines, *answers, strict=True):
        assert before == (record.incarnation, None, engine.capabilities.to_wire())
        assert after is before
        assert before[2] is engine.capabilities.wire
    # another process's answer is its own
    host = server.groups[0].engines[0]
    await engines[0].restart()
    fresh = await host.checked((None, None, True), "pause_generation", "abort")
    assert fresh[0] != records[0].incarnation and fresh is not answers[1][0]
    await asyncio.gather(*(e.close() for e in engines))


async def test_a_phase_names_the_engines_that_did_not_succeed_and_require_reads_them() -> None:
    """``PhaseResult.failed``: the engines whose outcome is not ``ok``, in the order their
    calls went out; a phase with none succeeded, and ``require`` refuses one with any (under
    ``DeadEnginePolicy.FAIL``, a dead engine among them)."""
    engines = sims(3, "a")
    group = EngineGroup("a", engines)
    runner = PhaseRunner("s", DeadEnginePolicy.FAIL, Bus())
    plan = Plan(Pause(PauseMode.ABORT), group.records)
    clean = await runner.run("pause", plan, 5.0)
    assert clean.failed == [] and all(o.ok for o in clean.outcomes.values())
    await engines[1].close()  # (a closed server refuses the connection: dead)
    again = Plan(Continue(), group.records)
    result = await runner.run("continue", again, 5.0)
    assert result.failed == ["a/1"]
    assert result.outcomes["a/1"].outcome is Outcome.DEAD
    assert [e for e, o in result.outcomes.items() if not o.ok] == result.failed
    live = tuple(r for r in group.records if r.alive)
    assert (await runner.require("pause", Plan(Pause(PauseMode.ABORT), live), 5.0)).failed == []
    slow = SimulatedEngine("slow", token_latency=0.001, op_latency={"pause_generation": 0.3})
    (late,) = EngineGroup("b", [slow]).records
    with pytest.raises(PhaseFailed) as failed:
        await runner.require("pause", Plan(Pause(PauseMode.ABORT), (late,)), 0.05)
    assert failed.value.outcomes["b/0"].outcome is Outcome.TIMED_OUT
    await runner.landed([late], 30.0, Op.CONTINUE)  # (the late pause lands before the close)
    for engine in [*engines, slow]:
        await engine.close()
