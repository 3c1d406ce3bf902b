"""The lifecycle on a real local Ray cluster, against simulated SGLang engine actors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import ray
from structlog.testing import capture_logs

from rollout_lifecycle import (
    Deadlines,
    EngineDead,
    EngineGroup,
    IllegalEngineOp,
    IllegalTransition,
    InvalidArgument,
    LifecycleConfig,
    LifecycleEvent,
    Outcome,
    PauseMode,
    PhaseFailed,
    RolloutServer,
    ServerState,
    Tag,
    WeightUpdate,
)
from rollout_lifecycle.testing import (
    calls_received,
    cycle_order_violations,
    released_ops,
    until,
    until_actor_gone,
    until_began,
)

Fleet = Callable[..., list[Any]]
RANDOM_LATENCY = {
    "pause_generation": (0.0, 0.03),
    "flush_cache": (0.0, 0.03),
    "release_memory_occupation": (0.0, 0.05),
    "resume_memory_occupation": (0.0, 0.05),
    "continue_generation": (0.0, 0.02),
}


async def histories(server: RolloutServer) -> dict[str, list[dict[str, Any]]]:
    ids = list(server.engines())
    got = await asyncio.gather(*(h.history.remote() for h in server.engines().values()))
    return dict(zip(ids, got, strict=True))


async def stats(engines: list[Any]) -> list[dict[str, int]]:
    return list(await asyncio.gather(*(h.stats.remote() for h in engines)))


async def until_received(engines: list[Any], count: int) -> None:
    """Every engine has taken ``count`` generate requests (a counter: it cannot be missed)."""

    async def received() -> bool:
        return all(s["submitted"] >= count for s in await stats(engines))

    await until(received, what=f"{count} request(s) submitted to every engine")


async def until_decoding(engines: list[Any], count: int) -> None:
    """Every engine runs ``count`` requests and has decoded a token for each since they all ran
    (a step decodes one token of every running request)."""

    async def running() -> bool:
        return all(s["running"] >= count for s in await stats(engines))

    await until(running, what=f"{count} running request(s) on every engine")
    floor = [s["tokens"] + count for s in await stats(engines)]

    async def decoded() -> bool:
        return all(s["tokens"] >= f for s, f in zip(await stats(engines), floor, strict=True))

    await until(decoded, what="a token of every running request")


def ops(history: list[dict[str, Any]]) -> list[str]:
    return [e["op"] for e in calls_received(history)]


def generate(handle: Any, i: int, max_new_tokens: int) -> Any:
    return handle.generate.remote(
        {"input_ids": [i, i + 1], "sampling_params": {"max_new_tokens": max_new_tokens}}
    )


async def disk_push(update: WeightUpdate) -> None:
    await asyncio.gather(
        *(
            h.update_weights_from_disk.remote("/ckpt", update.version)
            for h in update.engines.values()
        )
    )


async def test_barriers_hold_across_groups_with_random_latencies(engine_actors: Fleet) -> None:
    actor = engine_actors(3, label="actor", seed=11, op_latency=RANDOM_LATENCY, token_latency=0.003)
    critic = engine_actors(
        3, label="critic", seed=23, op_latency=RANDOM_LATENCY, token_latency=0.003
    )
    reward = engine_actors(
        2, label="reward", seed=37, op_latency=RANDOM_LATENCY, token_latency=0.003
    )
    server = RolloutServer(
        [
            EngineGroup("actor", actor),
            EngineGroup("critic", critic),
            EngineGroup("reward", reward, needs_offload=False),
        ]
    )
    for cycle in range(2):
        requests = [generate(h, i, 30) for i, h in enumerate(actor + critic + reward)]
        await until_received(actor + critic + reward, cycle + 1)
        await server.offload()
        assert server.state is ServerState.RELEASED
        await server.onload_weights()
        await server.update_weights(disk_push, version=f"v{cycle}")
        await server.onload_kv()
        assert server.state is ServerState.SERVING
        done = await asyncio.wait_for(asyncio.gather(*requests), timeout=30)
        assert all(r["meta_info"]["finish_reason"]["type"] == "length" for r in done)

    seen = await histories(server)
    offloaded = {k: v for k, v in seen.items() if not k.startswith("reward/")}
    assert cycle_order_violations(offloaded) == []
    for engine, history in offloaded.items():
        assert len(released_ops(history)) == 2, engine
        resumes = [e["tags"] for e in history if e["op"] == "resume_memory_occupation"]
        assert resumes == [["weights"], ["kv_cache", "cuda_graph"]] * 2, engine
    for engine, history in seen.items():
        if engine.startswith("reward/"):
            assert released_ops(history) == [], engine
            assert "resume_memory_occupation" not in ops(history), engine
    # Spelled out for the first round, across all six offloaded engines (its calls: the reads
    # that check them differ from round to round, the first contact's among them).
    calls = {k: [e for e in v if not e.get("check_of")] for k, v in offloaded.items()}
    first = {k: v[: len(v) // 2] for k, v in calls.items()}

    def spans(op: str, tag: str | None = None) -> list[tuple[float, float]]:
        return [
            (e["start"], e["end"])
            for h in first.values()
            for e in h
            if e["op"] == op and (tag is None or tag in e["tags"])
        ]

    assert max(e for _, e in spans("pause_generation")) < min(s for s, _ in spans("flush_cache"))
    assert max(e for _, e in spans("flush_cache")) < min(
        s for s, _ in spans("release_memory_occupation")
    )
    assert max(e for _, e in spans("resume_memory_occupation", "weights")) < min(
        s for s, _ in spans("resume_memory_occupation", "kv_cache")
    )
    assert max(e for _, e in spans("resume_memory_occupation", "kv_cache")) < min(
        s for s, _ in spans("continue_generation")
    )
    versions = await asyncio.gather(*(h.weight_version.remote() for h in actor + critic + reward))
    assert versions == ["v1"] * 8


async def test_cycle_checker_catches_a_broken_barrier() -> None:
    good = {
        "a": [
            {"op": "pause_generation", "tags": None, "start": 0.0, "end": 1.0},
            {"op": "flush_cache", "tags": None, "start": 2.0, "end": 3.0},
        ],
        "b": [
            {"op": "pause_generation", "tags": None, "start": 0.0, "end": 1.5},
            {"op": "flush_cache", "tags": None, "start": 2.0, "end": 3.0},
        ],
    }
    assert cycle_order_violations(good) == []
    bad = {k: [dict(e) for e in v] for k, v in good.items()}
    bad["b"][0]["end"] = 2.5  # b still pausing when a starts its flush
    assert len(cycle_order_violations(bad)) == 1


async def test_hook_observes_exactly_the_designed_state_sequence(engine_actors: Fleet) -> None:
    engines = engine_actors(3, token_latency=0.002)
    server = RolloutServer([EngineGroup("actor", engines)])
    seen: list[tuple[str, str]] = []

    async def record(event: LifecycleEvent) -> None:
        assert event.server.state is event.state
        seen.append((event.previous.value, event.state.value))

    for state in ServerState:
        server.on(state, record)
    await server.offload()
    await server.onload_weights()
    await server.onload_kv()
    assert [s for _, s in seen] == [
        "pausing",
        "drained",
        "released",
        "weights_restored",
        "kv_restored",
        "serving",
    ]
    assert seen[0][0] == "serving"
    seen.clear()
    async with server.paused():
        assert server.state is ServerState.DRAINED
    assert seen == [("serving", "pausing"), ("pausing", "drained"), ("drained", "serving")]


async def test_offload_twice_is_a_noop_the_second_time(engine_actors: Fleet) -> None:
    engines = engine_actors(3)
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.offload()
    before = await histories(server)
    assert list(await server.offload()) == ["lifecycle/offload/total_s"]  # no phase ran
    assert server.state is ServerState.RELEASED
    assert await histories(server) == before
    for history in before.values():
        assert len(released_ops(history)) == 1


async def test_illegal_calls_raise_and_send_nothing(engine_actors: Fleet) -> None:
    engines = engine_actors(3)
    server = RolloutServer([EngineGroup("actor", engines)])
    with pytest.raises(IllegalTransition) as err:
        await server.onload_kv()
    assert err.value.state == "serving"
    assert "weights_restored" in err.value.allowed
    assert "'serving'" in str(err.value)
    with pytest.raises(IllegalTransition):
        await server.onload_weights()
    assert all(h == [] for h in (await histories(server)).values())

    await server.offload()
    before = await histories(server)
    with pytest.raises(IllegalTransition) as err:
        await server.update_weights(disk_push, version="v1")
    assert err.value.state == "released"
    assert set(err.value.allowed) == {"drained", "weights_restored", "kv_restored"}
    with pytest.raises(IllegalTransition):
        await server.onload_kv()  # weights must come back before the KV cache
    with pytest.raises(IllegalTransition):
        await server.resume()  # generation on released memory
    assert await histories(server) == before
    assert server.state is ServerState.RELEASED


async def test_in_place_pause_is_refused_for_offload_before_any_engine_call(
    engine_actors: Fleet,
) -> None:
    engines = engine_actors(2)
    server = RolloutServer(
        [EngineGroup("actor", engines)], LifecycleConfig(pause_mode=PauseMode.IN_PLACE)
    )
    with pytest.raises(InvalidArgument, match="in_place"):
        await server.offload()
    assert server.state is ServerState.SERVING
    assert all(h == [] for h in (await histories(server)).values())
    # in_place is fine for a pause that keeps memory resident (a non-colocated weight sync).
    async with server.paused():
        assert server.state is ServerState.DRAINED
    assert server.state is ServerState.SERVING


async def test_retract_keeps_every_request_in_flight_and_aborts_none(engine_actors: Fleet) -> None:
    engines = engine_actors(2, token_latency=0.004)
    server = RolloutServer([EngineGroup("actor", engines)])
    requests = [generate(engines[i % 2], i, 400) for i in range(12)]
    await until_decoding(engines, 6)  # the pause finds every request decoding
    await server.offload()
    memory = await asyncio.gather(*(h.memory.remote() for h in engines))
    assert all(m == {"weights": 0, "kv_cache": 0, "cuda_graph": 0} for m in memory)
    await server.onload()
    results = await asyncio.wait_for(asyncio.gather(*requests), timeout=60)
    assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["length"] * 12
    assert all(len(r["output_ids"]) == 400 for r in results)
    assert sum(r["meta_info"]["num_retractions"] for r in results) >= 1


async def test_abort_returns_every_request_in_flight_with_its_partial_output(
    engine_actors: Fleet,
) -> None:
    engines = engine_actors(2, token_latency=0.004)
    server = RolloutServer(
        [EngineGroup("actor", engines)], LifecycleConfig(pause_mode=PauseMode.ABORT)
    )
    requests = [generate(engines[i % 2], i, 400) for i in range(8)]
    await until_decoding(engines, 4)  # each has output when the abort comes
    await server.offload()
    # Aborted requests answer during the pause, before anything is restored.
    results = await asyncio.wait_for(asyncio.gather(*requests), timeout=10)
    for r in results:
        assert r["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(r["output_ids"]) < 400
    await server.onload()
    assert server.state is ServerState.SERVING


async def test_group_without_offload_keeps_serving_during_offload(engine_actors: Fleet) -> None:
    actor = engine_actors(2, token_latency=0.002)
    reward = engine_actors(2, token_latency=0.002)
    server = RolloutServer(
        [EngineGroup("actor", actor), EngineGroup("reward", reward, needs_offload=False)]
    )
    await server.offload()
    results = await asyncio.wait_for(
        asyncio.gather(*(generate(h, 1, 8) for h in reward)), timeout=10
    )
    assert all(r["meta_info"]["finish_reason"]["type"] == "length" for r in results)
    snap = server.snapshot().engines()
    assert snap["actor/0"].released == ("weights", "kv_cache", "cuda_graph")
    assert snap["reward/0"].released == () and not snap["reward/0"].paused
    await server.onload()


async def test_guard_refuses_each_fatal_misuse_and_the_engines_live(engine_actors: Fleet) -> None:
    engines = engine_actors(3)
    group = EngineGroup("actor", engines)
    server = RolloutServer([group])
    with pytest.raises(IllegalEngineOp, match="not released"):
        group.resume_memory([Tag.KV_CACHE])  # resume of a tag that is not released
    with pytest.raises(IllegalEngineOp, match="not paused"):
        group.release_memory([Tag.KV_CACHE])  # release of a busy engine
    await server.offload()
    with pytest.raises(IllegalEngineOp, match="already released"):
        group.release_memory([Tag.KV_CACHE])  # double release
    await server.onload_weights()
    with pytest.raises(IllegalEngineOp, match="released"):
        group.continue_generation()  # continue with the KV cache still released
    with pytest.raises(IllegalEngineOp, match="not released"):
        group.resume_memory([Tag.WEIGHTS])  # weights were resumed already
    await server.onload_kv()
    infos = await asyncio.gather(*(h.state.remote() for h in engines))
    assert all(not i["paused"] and i["released_tags"] == [] for i in infos)
    for history in (await histories(server)).values():
        assert all(e["outcome"] != "fatal" for e in history)


async def test_without_the_guard_the_same_misuse_kills_the_engine(engine_actors: Fleet) -> None:
    (engine,) = engine_actors(1)
    await engine.pause_generation.remote("retract")
    await engine.flush_cache.remote(1.0)
    await engine.release_memory_occupation.remote(["kv_cache"])
    with pytest.raises(EngineDead):
        await engine.release_memory_occupation.remote(["kv_cache"])
    with pytest.raises(EngineDead):
        await engine.server_info.remote()
    history = await engine.history.remote()
    assert [e["outcome"] for e in history][-2:] == ["fatal", "dead"]


async def test_failed_pause_releases_nothing_and_continues_the_paused(engine_actors: Fleet) -> None:
    fast = engine_actors(2)
    (slow,) = engine_actors(1, op_latency={"pause_generation": 2.0})
    server = RolloutServer(
        [EngineGroup("actor", [*fast, slow])],
        LifecycleConfig(deadlines=Deadlines(pause=0.5)),
    )
    with pytest.raises(PhaseFailed) as err:
        await server.offload()
    assert err.value.phase == "pause"
    assert err.value.failed_engines == ["actor/2"]
    assert err.value.outcomes["actor/2"].outcome is Outcome.TIMED_OUT
    assert err.value.outcomes["actor/0"].ok
    assert server.state is ServerState.FAILED
    for engine, history in (await histories(server)).items():
        assert released_ops(history) == [], engine
        # The slow pause landed before its continue was sent, so every engine serves again.
        assert ops(history) == ["pause_generation", "continue_generation"], engine
        assert history[1]["start"] >= history[0]["end"], engine
    infos = await asyncio.gather(*(h.state.remote() for h in [*fast, slow]))
    assert [i["paused"] for i in infos] == [False, False, False]


async def test_cancelled_offload_settles_the_phase_before_cancelling(engine_actors: Fleet) -> None:
    engines = engine_actors(3, op_latency={"pause_generation": 1.0})
    server = RolloutServer([EngineGroup("actor", engines)])
    task = asyncio.ensure_future(server.offload())
    await until_began(engines, "pause_generation")  # inside the pause phase
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The drain in flight finished; the release never started.
    assert server.state is ServerState.DRAINED
    snap = server.snapshot().engines()
    assert all(e.paused and e.flushed and e.released == () for e in snap.values())
    for history in (await histories(server)).values():
        assert ops(history) == ["pause_generation", "flush_cache"]
    await server.offload()  # and carrying on works
    assert server.state is ServerState.RELEASED


async def test_concurrent_calls_are_serialized(engine_actors: Fleet) -> None:
    engines = engine_actors(2, op_latency={"release_memory_occupation": 0.1})
    server = RolloutServer([EngineGroup("actor", engines)])
    await asyncio.gather(server.offload(), server.offload(), server.offload())
    for history in (await histories(server)).values():
        assert len(released_ops(history)) == 1


async def test_events_cover_every_phase_and_engine_call(engine_actors: Fleet) -> None:
    engines = engine_actors(2)
    server = RolloutServer([EngineGroup("actor", engines)], name="events-test")
    with capture_logs() as logs:
        await server.offload()
    phases = [e for e in logs if e["event"] in ("phase.start", "phase.end")]
    assert [(e["event"], e["phase"]) for e in phases] == [
        ("phase.start", "pause"),
        ("phase.end", "pause"),
        ("phase.start", "flush"),
        ("phase.end", "flush"),
        ("phase.start", "release"),
        ("phase.end", "release"),
    ]
    assert all(e["server"] == "events-test" for e in phases)
    ends = [e for e in logs if e["event"] == "engine_call.end"]
    starts = [e for e in logs if e["event"] == "engine_call.start"]
    assert len(ends) == len(starts) == 6
    for e in ends:
        assert e["outcome"] == "ok" and e["duration_s"] >= 0
        assert e["group"] == "actor" and e["engine"].startswith("actor/")
        assert e["phase"] in ("pause", "flush", "release")
    assert all(e["outcome"] == "ok" for e in phases if e["event"] == "phase.end")


async def test_offloaded_context_restores_even_when_the_body_raises(engine_actors: Fleet) -> None:
    engines = engine_actors(2)
    server = RolloutServer([EngineGroup("actor", engines)])
    pushed: list[str] = []

    async def push_weights(event: LifecycleEvent) -> None:
        await event.server.update_weights(disk_push, version="v7")
        pushed.append(event.server.state.value)

    server.on("weights_restored", push_weights)
    with pytest.raises(RuntimeError, match="trainer blew up"):
        async with server.offloaded():
            assert server.state is ServerState.RELEASED
            raise RuntimeError("trainer blew up")
    assert server.state is ServerState.SERVING
    assert pushed == ["weights_restored"]
    assert await asyncio.gather(*(h.weight_version.remote() for h in engines)) == ["v7", "v7"]


async def test_a_dead_actor_fails_the_phase_and_is_named(engine_actors: Fleet) -> None:
    engines = engine_actors(3)
    server = RolloutServer([EngineGroup("actor", engines)])
    ray.kill(engines[1])
    await until_actor_gone(engines[1])
    with pytest.raises(PhaseFailed) as err:
        await server.offload()
    assert err.value.failed_engines == ["actor/1"]
    assert err.value.outcomes["actor/1"].outcome is Outcome.DEAD
    assert not server.snapshot().engines()["actor/1"].alive
    assert server.state is ServerState.FAILED


async def test_group_methods_issue_refs_without_waiting(engine_actors: Fleet) -> None:
    engines = engine_actors(3, op_latency={"pause_generation": 0.5})
    group = EngineGroup("actor", engines)
    calls = group.pause_generation(PauseMode.RETRACT)
    refs = [c.ref for c in calls]
    assert all(isinstance(r, ray.ObjectRef) for r in refs)
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    assert ready == []  # issued, not awaited
    await asyncio.wait_for(asyncio.gather(*refs), timeout=10)


async def test_guard_refuses_in_place_release_and_writes_into_released_weights(
    engine_actors: Fleet,
) -> None:
    engines = engine_actors(2, token_latency=0.004)
    group = EngineGroup("actor", engines)
    server = RolloutServer([group], LifecycleConfig(pause_mode=PauseMode.IN_PLACE))
    requests = [generate(h, i, 200) for i, h in enumerate(engines)]
    await until_decoding(engines, 1)
    async with server.paused():
        # Requests hold their KV cache under an in_place pause: releasing would kill the engine.
        with pytest.raises(IllegalEngineOp, match="in_place"):
            group.release_memory([Tag.KV_CACHE])
    await asyncio.wait_for(asyncio.gather(*requests), timeout=30)
    offloading = RolloutServer([EngineGroup("actor", engines)])
    await offloading.offload()
    with pytest.raises(IllegalEngineOp, match="weights are released"):
        offloading.groups[0].update_weight_version("v2")
    await offloading.onload()
    for history in (await histories(offloading)).values():
        assert all(e["outcome"] != "fatal" for e in history)


async def test_probe_never_uses_a_generating_health_check_on_paused_engines(
    engine_actors: Fleet,
) -> None:
    engines = engine_actors(2, health_timeout=5.0)
    server = RolloutServer([EngineGroup("actor", engines)])
    await server.offload()
    outcomes = await asyncio.wait_for(server.probe(), timeout=5)
    assert {k: v.outcome for k, v in outcomes.items()} == {
        "actor/0": Outcome.OK,
        "actor/1": Outcome.OK,
    }
    for history in (await histories(server)).values():
        assert "health" not in [e["op"] for e in history]
        # the probe reads who the engine is and whether it is paused, never generating (the
        # simulator answers both in one call, as /server_info, /ping and /ready tell them)
        last = calls_received(history)[-1]
        assert last["op"] == "observe" and last["checks"] == ["observe"]
    ray.kill(engines[1])
    await until_actor_gone(engines[1])
    outcomes = await asyncio.wait_for(server.probe(), timeout=5)
    assert outcomes["actor/1"].outcome is Outcome.DEAD
    assert not server.snapshot().engines()["actor/1"].alive
