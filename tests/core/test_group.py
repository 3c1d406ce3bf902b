"""``EngineGroup``: engines of one role and their records; a slot taken by a replacement; the
guards run before anything is sent; and the calls a group issues, one per engine its state
lets the operation reach, sent without waiting.

The groups here hold simulated engines in process, with no server around them: what a group
issues is awaited by the test itself, and what reached each engine is read from its history.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollout_lifecycle import (
    EngineGroup,
    EngineHost,
    IllegalEngineOp,
    InvalidArgument,
    PauseMode,
    SGLangHTTPEngine,
    SimulatedEngine,
    Tag,
)
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.outcome import EngineOutcome, Outcome
from rollout_lifecycle.core.group import shown
from rollout_lifecycle.core.runner import Calls
from rollout_lifecycle.testing.fleets import received_ops as ops
from rollout_lifecycle.testing.fleets import simulated_engines as sims


async def settle(calls: Calls) -> list[Any]:
    """Await what a group issued and write each outcome into its record, as a phase would."""
    answers = await asyncio.gather(*calls.refs)
    for record, op, tags, mode in zip(
        calls.records, calls.ops, calls.tags, calls.modes, strict=True
    ):
        record.apply(op, tags, mode, EngineOutcome(Outcome.OK))
    return answers


async def close(*engines: SimulatedEngine) -> None:
    for engine in engines:
        await engine.close()


def test_engine_ids_are_group_and_index_and_a_bare_backend_gets_a_host_of_its_own() -> None:
    engines = sims(3)
    group = EngineGroup("actor", engines, needs_offload=False)
    assert [r.id for r in group.records] == ["actor/0", "actor/1", "actor/2"]
    assert {r.group for r in group.records} == {"actor"}
    assert all(isinstance(h, EngineHost) for h in group.engines)
    assert [h.backend for h in group.engines] == engines
    assert group.engines == tuple(r.handle for r in group.records)
    # an engine host given as it is stays the group's handle, not wrapped again
    host = EngineHost(SimulatedEngine("hosted"))
    assert EngineGroup("critic", [host]).engines == (host,)
    assert repr(group) == "EngineGroup('actor', engines=3, needs_offload=False)"
    assert group.name == "actor" and group.needs_offload is False
    # a fresh group's records: alive, serving, everything resident, nothing known yet
    assert all(r.alive and not r.paused and not r.released and not r.stale for r in group.records)


def test_a_backend_and_a_host_of_that_backend_are_one_engine() -> None:
    engine = SimulatedEngine("e")
    with pytest.raises(
        InvalidArgument, match=r"engine #1 of group 'a' is the same engine as engine #0"
    ):
        EngineGroup("a", [engine, EngineHost(engine)])
    with pytest.raises(
        InvalidArgument,
        match=r"engine #2 of group 'a' is the same engine as engine #0 \(http://localhost:30000 "
        r"and http://127.0.0.1:30000 reach one server, url http://this-host:30000\); give each",
    ):
        EngineGroup(
            "a",
            [
                SGLangHTTPEngine("http://127.0.0.1:30000"),
                SimulatedEngine("x"),
                SGLangHTTPEngine("http://localhost:30000/"),
            ],
        )
    assert engine.history() == []


def test_an_identity_is_shown_by_its_kind() -> None:
    assert shown(("url", "http://h:1")) == "url http://h:1"
    assert shown(("actor", "abc123")) == "actor abc123"
    assert shown(object()) == "the same object"
    assert shown(("other", "x")) == "the same object"


async def test_replace_puts_a_fresh_stale_engine_in_the_slot_and_returns_the_old_handle() -> None:
    engines = sims(2)
    group = EngineGroup("actor", engines)
    record = group.records[1]
    record.paused, record.pause_mode, record.flushed = True, PauseMode.RETRACT, True
    record.released.add(Tag.KV_CACHE)
    record.uncertain.add(Tag.WEIGHTS)
    record.alive, record.incarnation = False, "old-process"
    old = record.handle
    fresh = SimulatedEngine("fresh", token_latency=0.001)
    assert group.replace(record, fresh) is old
    assert group.records[1] is record and record.id == "actor/1"
    assert isinstance(record.handle, EngineHost) and record.handle.backend is fresh
    assert group.engines[1] is record.handle
    # what a fresh server is: alive, serving, all memory resident, without the fleet's weights
    assert record.alive and not record.paused and record.pause_mode is None
    assert not record.flushed and not record.released and not record.uncertain
    assert record.stale and record.incarnation is None
    # the other record is untouched
    assert group.records[0].handle.backend is engines[0] and not group.records[0].stale
    await close(*engines, fresh)


async def test_replace_refuses_an_outside_record_and_an_engine_already_in_the_group() -> None:
    engines = sims(2)
    group = EngineGroup("actor", engines)
    other = EngineGroup("critic", sims(1, "c"))
    before = group.engines
    with pytest.raises(InvalidArgument, match="engine critic/0 is not in group 'actor'"):
        group.replace(other.records[0], SimulatedEngine("fresh"))
    with pytest.raises(
        InvalidArgument, match="the replacement for actor/0 is already in the group"
    ):
        group.replace(group.records[0], engines[1])
    assert group.engines == before and not any(r.stale for r in group.records)
    # the engine a slot already holds may take it again (a server restarted at its address)
    assert group.replace(group.records[0], engines[0]) is before[0]
    assert group.records[0].stale
    await close(*engines, *[h.backend for h in other.engines])


def test_live_leaves_out_the_dead_in_order() -> None:
    group = EngineGroup("actor", sims(4))
    group.records[1].alive = False
    group.records[3].alive = False
    assert [r.id for r in group.live()] == ["actor/0", "actor/2"]


async def test_preflight_runs_the_guards_and_sends_nothing() -> None:
    engines = sims(2)
    group = EngineGroup("actor", engines)
    with pytest.raises(IllegalEngineOp, match="actor/0"):
        group.preflight(Op.RELEASE, [Tag.KV_CACHE])  # not paused: a release would kill it
    with pytest.raises(IllegalEngineOp, match="actor/0"):
        group.preflight("resume_memory_occupation", ["kv_cache"])  # not released
    group.preflight(Op.CONTINUE)  # harmless: nothing paused, so nothing to continue
    assert all(ops(e) == [] for e in engines)
    # a group that keeps its memory is never released: no target, so no refusal
    EngineGroup("reward", sims(1, "r"), needs_offload=False).preflight(
        "release_memory_occupation", ["weights"]
    )
    await close(*engines)


async def test_issued_calls_reach_the_engines_the_state_lets_the_operation_reach() -> None:
    engines = sims(3)
    group = EngineGroup("actor", engines)
    group.records[2].alive = False  # known dead: never called again
    calls = group.pause_generation(PauseMode.RETRACT)
    assert [r.id for r in calls.records] == ["actor/0", "actor/1"]
    assert all(o is Op.PAUSE for o in calls.ops)
    # issued, not awaited: the intent is recorded before the answer
    assert all(r.pause_unknown for r in calls.records)
    await settle(calls)
    assert [e.state()["paused"] for e in engines] == [True, True, False]
    await settle(group.flush_cache(5.0, 0.01))
    calls = group.release_memory(["kv_cache", "cuda_graph"])
    assert calls.tags == [(Tag.KV_CACHE, Tag.CUDA_GRAPH)] * 2
    await settle(calls)
    assert [sorted(e.state()["released_tags"]) for e in engines[:2]] == [
        ["cuda_graph", "kv_cache"]
    ] * 2
    # all or nothing: an engine that did not release the tags refuses the resume everywhere
    group.records[1].released.clear()
    with pytest.raises(IllegalEngineOp, match="actor/1"):
        group.resume_memory(["kv_cache", "cuda_graph"])
    assert all("resume_memory_occupation" not in ops(e) for e in engines)
    assert ops(engines[2]) == []
    await close(*engines)


async def test_a_group_that_keeps_its_memory_issues_no_release_or_resume() -> None:
    engines = sims(2)
    group = EngineGroup("reward", engines, needs_offload=False)
    await settle(group.pause_generation(PauseMode.RETRACT))
    await settle(group.flush_cache(5.0, 0.01))
    assert len(group.release_memory(["weights"])) == 0
    assert len(group.resume_memory(["weights"])) == 0
    await settle(group.continue_generation())
    assert not any(e.state()["paused"] for e in engines)
    assert all("release_memory_occupation" not in ops(e) for e in engines)
    await close(*engines)


async def test_session_version_and_probe_calls_reach_every_live_engine() -> None:
    engines = sims(3)
    group = EngineGroup("actor", engines)
    group.records[1].alive = False
    await settle(group.pause_generation(PauseMode.RETRACT))
    await settle(group.begin_weight_update())
    assert [e.state()["weight_update_session_open"] for e in engines] == [True, False, True]
    await settle(group.end_weight_update())
    await settle(group.update_weight_version("v7"))
    assert [await e.weight_version() for e in engines] == ["v7", "default", "v7"]
    probe = group.probe()
    assert [r.id for r in probe.records] == ["actor/0", "actor/2"]
    answers = await settle(probe)
    assert len(answers) == 2 and all(isinstance(a, dict) for a in answers)
    assert not any(e.state()["weight_update_session_open"] for e in engines)
    assert ops(engines[1]) == ["weight_version"]  # (the test's own read)
    await close(*engines)
