"""In-process tests of the pieces under the server: config, guards, states, errors, groups."""

from __future__ import annotations

import asyncio

import pytest

from rollout_lifecycle import (
    Deadlines,
    EngineGroup,
    EngineHost,
    EngineOutcome,
    IllegalEngineOp,
    InvalidArgument,
    LifecycleConfig,
    Outcome,
    PauseMode,
    RolloutServer,
    ServerState,
    SimulatedEngine,
    Tag,
)
from rollout_lifecycle.backends.engine import incarnation_of
from rollout_lifecycle.core.ledger import EngineRecord
from rollout_lifecycle.core.runner import Calls
from rollout_lifecycle.core.states import TRANSITIONS, sources_of
from rollout_lifecycle.testing import calls_received


def test_server_states_are_exactly_the_designed_names() -> None:
    assert [s.value for s in ServerState] == [
        "serving",
        "pausing",
        "drained",
        "released",
        "weights_restored",
        "kv_restored",
        "failed",
    ]


def test_transition_table_allows_weight_writes_only_where_weights_are_resident() -> None:
    assert set(sources_of("write_weights")) == {
        ServerState.DRAINED,
        ServerState.WEIGHTS_RESTORED,
        ServerState.KV_RESTORED,
    }
    assert ServerState.RELEASED not in sources_of("write_weights")
    assert sources_of("restore_kv") == (ServerState.WEIGHTS_RESTORED,)
    assert set(sources_of("resume")) == {ServerState.DRAINED, ServerState.KV_RESTORED}
    assert ServerState.FAILED not in sources_of("fail")
    assert all("trigger" in row and "source" in row for row in TRANSITIONS)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"pause_mode": "pause"}, "'pause'"),
        ({"deadlines": 3}, "deadlines"),
        ({"release_tags": ["kv_cache", "weight"]}, "'weight'"),
        ({"release_tags": []}, "empty"),
        ({"release_tags": ["kv_cache", "kv_cache"]}, "twice"),
        ({"release_tags": "kv_cache"}, "'kv_cache'"),
        ({"dead_engines": "ignore"}, "'ignore'"),
        ({"flush_retry_interval": 0}, "0"),
    ],
)
def test_bad_config_names_the_bad_value(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        LifecycleConfig(**kwargs)  # type: ignore[arg-type]
    assert needle in str(err.value)


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "10", True])
def test_bad_deadline_names_the_phase_and_value(value: object) -> None:
    with pytest.raises(InvalidArgument) as err:
        Deadlines(flush=value)  # type: ignore[arg-type]
    assert "'flush'" in str(err.value) and repr(value) in str(err.value)


def test_groups_and_servers_reject_bad_input_before_touching_engines() -> None:
    engine = SimulatedEngine("e")
    with pytest.raises(InvalidArgument, match="no engines"):
        EngineGroup("actor", [])
    with pytest.raises(InvalidArgument, match="same object"):
        EngineGroup("actor", [engine, engine])
    with pytest.raises(InvalidArgument, match="'a/b'"):
        EngineGroup("a/b", [engine])
    with pytest.raises(InvalidArgument, match="str"):
        EngineGroup("actor", ["http://localhost:30000"])
    with pytest.raises(InvalidArgument, match="at least one"):
        RolloutServer([])
    host = EngineHost(engine)
    with pytest.raises(InvalidArgument, match="named 'actor'"):
        RolloutServer([EngineGroup("actor", [host]), EngineGroup("actor", [SimulatedEngine()])])
    with pytest.raises(InvalidArgument, match="belongs to one group"):
        RolloutServer([EngineGroup("a", [host]), EngineGroup("b", [host])])
    with pytest.raises(InvalidArgument, match="LifecycleConfig"):
        RolloutServer([EngineGroup("a", [host])], config={"pause_mode": "retract"})  # type: ignore[arg-type]
    assert engine.history() == []


def test_engine_record_guards_each_fatal_call() -> None:
    record = EngineRecord(id="actor/0", group="actor", handle=None)
    with pytest.raises(IllegalEngineOp, match="not released"):
        record.check_resume([Tag.KV_CACHE])
    with pytest.raises(IllegalEngineOp, match="not paused"):
        record.check_release([Tag.KV_CACHE])
    ok = EngineOutcome(Outcome.OK)
    record.apply("pause_generation", (), PauseMode.RETRACT, ok)
    with pytest.raises(IllegalEngineOp, match="flush"):
        record.check_release([Tag.KV_CACHE])
    record.apply("flush_cache", (), None, ok)
    record.check_release([Tag.KV_CACHE])
    record.apply("release_memory_occupation", (Tag.KV_CACHE,), None, ok)
    with pytest.raises(IllegalEngineOp, match="already released"):
        record.check_release([Tag.KV_CACHE, Tag.WEIGHTS])
    with pytest.raises(IllegalEngineOp, match="kv_cache"):
        record.check_continue()
    with pytest.raises(IllegalEngineOp, match="not released"):
        record.check_resume([Tag.KV_CACHE, Tag.WEIGHTS])  # the resume-everything trap
    record.check_resume([Tag.KV_CACHE])
    record.apply("release_memory_occupation", (Tag.WEIGHTS,), None, ok)
    with pytest.raises(IllegalEngineOp, match="weights are released"):
        record.check_write_weights()


def test_in_place_pause_never_allows_a_release() -> None:
    record = EngineRecord(id="a/0", group="a", handle=None)
    ok = EngineOutcome(Outcome.OK)
    record.apply("pause_generation", (), PauseMode.IN_PLACE, ok)
    record.apply("flush_cache", (), None, ok)
    with pytest.raises(IllegalEngineOp, match="in_place"):
        record.check_release([Tag.KV_CACHE])


def test_a_release_without_answer_makes_its_tags_unknown_and_blocks_both_directions() -> None:
    record = EngineRecord(id="a/0", group="a", handle=None)
    ok = EngineOutcome(Outcome.OK)
    record.apply("pause_generation", (), PauseMode.RETRACT, ok)
    record.apply("flush_cache", (), None, ok)
    record.apply(
        "release_memory_occupation", (Tag.KV_CACHE,), None, EngineOutcome(Outcome.TIMED_OUT)
    )
    with pytest.raises(IllegalEngineOp, match="unknown"):
        record.check_release([Tag.KV_CACHE])
    with pytest.raises(IllegalEngineOp, match="unknown"):
        record.check_resume([Tag.KV_CACHE])
    with pytest.raises(IllegalEngineOp):
        record.check_continue()
    assert record.snapshot().uncertain == ("kv_cache",)


async def test_in_process_fleet_runs_a_full_cycle_and_reports_state() -> None:
    engines = [SimulatedEngine(f"e{i}", token_latency=0.001) for i in range(3)]
    server = RolloutServer([EngineGroup("actor", engines)])
    metrics = await server.offload()
    assert {"lifecycle/offload/pause_s", "lifecycle/offload/flush_s"} <= metrics.keys()
    assert all(e.memory() == {"weights": 0, "kv_cache": 0, "cuda_graph": 0} for e in engines)
    snap = server.snapshot()
    assert snap.state is ServerState.RELEASED
    assert snap.to_dict()["groups"][0]["engines"][0]["released"] == (
        "weights",
        "kv_cache",
        "cuda_graph",
    )
    await server.onload()
    assert all(e.memory()["kv_cache"] > 0 for e in engines)
    assert server.state is ServerState.SERVING
    await asyncio.gather(*(e.close() for e in engines))


async def test_hook_failure_keeps_the_entered_state_and_retry_works() -> None:
    from rollout_lifecycle import HookFailed

    engines = [SimulatedEngine(f"e{i}") for i in range(2)]
    server = RolloutServer([EngineGroup("actor", engines)])
    calls = 0

    def flaky(event: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("trainer not ready")

    server.on("released", flaky)
    with pytest.raises(HookFailed) as err:
        await server.offload()
    assert err.value.state == "released"
    assert isinstance(err.value.__cause__, RuntimeError)
    assert server.state is ServerState.RELEASED
    await server.onload()
    assert server.state is ServerState.SERVING
    await server.offload()
    assert calls == 2
    await server.onload()


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
    assert answers[:3] == [[incarnation_of(a), None, declared] for a in answers[5:]]
    for engine in engines[:3]:  # the probe came after the pause, which was checked first
        received = calls_received(engine.history())
        assert [c["op"] for c in received] == ["pause_generation", "server_info"]
        assert received[0]["checks"] == ["observe"]
    await asyncio.gather(*(e.close() for e in engines))
