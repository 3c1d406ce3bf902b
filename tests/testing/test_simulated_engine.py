"""Direct tests of the simulated SGLang engine: it must keep SGLang 0.5.23's lifecycle contract.

Pure asyncio, no Ray. Every fatal misuse in docs/sglang-contract.md must kill the engine for good.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from rollout_lifecycle.contract.exceptions import EngineDead, EngineRejected, InvalidArgument
from rollout_lifecycle.contract.outcome import SESSION_OPEN
from rollout_lifecycle.contract.values import ALL_TAGS, PauseMode, Tag
from rollout_lifecycle.testing import collector_load, until
from rollout_lifecycle.testing.simulated import SimulatedEngine

GIB = 1 << 30
Result = dict[str, Any]
MakeEngine = Callable[..., SimulatedEngine]


@pytest.fixture
async def make_engine() -> AsyncIterator[MakeEngine]:
    """Build engines with a fast default token latency; close them all when the test ends."""
    engines: list[SimulatedEngine] = []

    def make(**options: Any) -> SimulatedEngine:
        options.setdefault("token_latency", 0.001)
        engine = SimulatedEngine(**options)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.close()


def submit(
    engine: SimulatedEngine,
    max_new_tokens: int = 16,
    *,
    prompt: tuple[int, ...] = (1, 2, 3),
    rid: str | None = None,
) -> asyncio.Task[Result]:
    request: dict[str, Any] = {
        "input_ids": list(prompt),
        "sampling_params": {"max_new_tokens": max_new_tokens},
    }
    if rid is not None:
        request["rid"] = rid
    return asyncio.create_task(engine.generate(request))


async def gather(tasks: list[asyncio.Task[Result]], timeout: float = 5.0) -> list[Result]:
    return await asyncio.wait_for(asyncio.gather(*tasks), timeout)


def finish_type(result: Result) -> str:
    kind: str = result["meta_info"]["finish_reason"]["type"]
    return kind


def every_call(engine: SimulatedEngine) -> list[tuple[str, Callable[[], Awaitable[Any]]]]:
    """One call of every engine method that talks to the server, named by its op."""
    return [
        ("pause_generation", lambda: engine.pause_generation(PauseMode.RETRACT)),
        ("continue_generation", engine.continue_generation),
        ("flush_cache", lambda: engine.flush_cache(0.0)),
        ("release_memory_occupation", lambda: engine.release_memory_occupation([Tag.WEIGHTS])),
        ("resume_memory_occupation", lambda: engine.resume_memory_occupation([Tag.WEIGHTS])),
        ("begin_weight_update", engine.begin_weight_update),
        ("end_weight_update", engine.end_weight_update),
        (
            "update_weights_from_disk",
            lambda: engine.update_weights_from_disk(
                "/m", weight_version="9", flush_cache=False, abort_all_requests=False
            ),
        ),
        (
            "update_weights_from_tensor",
            lambda: engine.update_weights_from_tensor(
                b"w", weight_version="9", flush_cache=False, abort_all_requests=False
            ),
        ),
        ("update_weight_version", lambda: engine.update_weight_version("9")),
        ("weight_version", engine.weight_version),
        ("server_info", engine.server_info),
        ("health", engine.health),
        ("abort_request", lambda: engine.abort_request(abort_all=True)),
        ("generate", lambda: engine.generate({"input_ids": [1], "sampling_params": {}})),
    ]


async def assert_dead_for_good(engine: SimulatedEngine, reason: str) -> None:
    """The engine is dead because of ``reason`` and every later call raises ``EngineDead``."""
    assert engine.dead
    assert engine.death_reason is not None and reason in engine.death_reason
    assert engine.memory() == {t.value: 0 for t in ALL_TAGS}
    before = len(engine.history())
    calls = every_call(engine)
    for op, call in calls:
        with pytest.raises(EngineDead) as info:
            await asyncio.wait_for(call(), 1.0)
        assert info.value.op == op
        assert info.value.message == f"engine is dead: {engine.death_reason}"
    later = engine.history()[before:]
    assert [h["op"] for h in later] == [op for op, _ in calls if op != "generate"]
    assert {h["outcome"] for h in later} == {"dead"}


async def drained_and_released(engine: SimulatedEngine, tags: list[Tag] | None = None) -> None:
    await engine.pause_generation(PauseMode.RETRACT)
    await engine.flush_cache(0.0)  # no timeout: the retracted requests do not count
    await engine.release_memory_occupation(tags or list(ALL_TAGS))


# ------------------------------------------------------------------ generation


async def test_generate_is_deterministic_and_stops_at_max_new_tokens(
    make_engine: MakeEngine,
) -> None:
    a, b = make_engine(label="a"), make_engine(label="b")
    first, second, other = await gather([submit(a, 8), submit(b, 8), submit(a, 8, prompt=(9, 9))])
    assert first["output_ids"] == second["output_ids"]
    assert first["output_ids"] != other["output_ids"]
    assert len(first["output_ids"]) == 8 and len(first["text"]) == 8
    meta = first["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (3, 8)
    assert meta["weight_version"] == "default"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 8}]
    assert meta["num_retractions"] == 0 and meta["cached_tokens"] == 0
    text = await asyncio.wait_for(a.generate({"text": "hi", "sampling_params": {}}), 2.0)
    assert len(text["output_ids"]) == 16 and text["meta_info"]["prompt_tokens"] == 2


async def test_prefix_cache_remembers_finished_prompts_until_flushed(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    await gather([submit(engine, 2)])
    assert engine.stats()["prefix_cache_size"] == 1
    (again,) = await gather([submit(engine, 2)])
    assert again["meta_info"]["cached_tokens"] == 3
    await engine.flush_cache(1.0)
    assert engine.stats()["prefix_cache_size"] == 0


async def test_bad_generate_request_is_rejected_with_400(make_engine: MakeEngine) -> None:
    engine = make_engine()
    for request in ({}, {"input_ids": [1], "text": "x"}, {"input_ids": [1], "rid": 5}):
        with pytest.raises(EngineRejected) as info:
            await engine.generate(request)
        assert info.value.status == 400
    assert not engine.dead


async def test_cancelled_generate_leaves_no_request_behind(make_engine: MakeEngine) -> None:
    engine = make_engine()
    task = submit(engine, 10_000)
    await until(lambda: engine.stats()["tokens"] > 0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.stats()["in_flight"] == 0
    await engine.flush_cache(0.0)


# ------------------------------------------------------------------ pause modes


async def test_pause_abort_returns_every_request_with_partial_output(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    tasks = [submit(engine, 1000, prompt=(i,)) for i in range(4)]
    await until(lambda: engine.stats()["tokens"] >= 12)
    await engine.pause_generation(PauseMode.ABORT)
    # The call answers only once nothing is in flight.
    assert all(t.done() for t in tasks)
    results = await gather(tasks)
    for result in results:
        assert finish_type(result) == "abort"
        assert set(result["meta_info"]["finish_reason"]) == {
            "type",
            "message",
            "status_code",
            "err_type",
        }
        assert 0 < len(result["output_ids"]) < 1000
    assert engine.paused and engine.pause_mode == "abort"
    assert not await engine.ready()
    assert engine.stats()["in_flight"] == 0 and engine.stats()["aborted"] == 4


@pytest.mark.looptime
async def test_pause_retract_keeps_requests_that_finish_after_continue(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    tasks = [submit(engine, 40, prompt=(i,)) for i in range(4)]
    await until(lambda: engine.stats()["tokens"] >= 8)
    await engine.pause_generation(PauseMode.RETRACT)
    assert not any(t.done() for t in tasks)
    assert (engine.stats()["running"], engine.stats()["waiting"]) == (0, 4)
    await engine.flush_cache(0.0)  # the waiting queue does not count while paused
    await asyncio.sleep(0.1)  # virtual: time for 100 steps, more than any request needs
    assert not any(t.done() for t in tasks)
    await engine.continue_generation()
    results = await gather(tasks)
    for result in results:
        assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
        assert len(result["output_ids"]) == 40
        assert result["meta_info"]["num_retractions"] >= 1
    assert engine.stats()["aborted"] == 0 and engine.stats()["completed"] == 4


async def test_pause_in_place_keeps_requests_running_and_rejects_flush(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine(token_latency=0.002)
    tasks = [submit(engine, 50, prompt=(i,)) for i in range(2)]
    await until(lambda: engine.stats()["tokens"] >= 4)
    await engine.pause_generation(PauseMode.IN_PLACE)
    assert engine.stats()["running"] == 2
    with pytest.raises(EngineRejected) as info:
        await engine.flush_cache(0.0)
    assert info.value.status == 400 and info.value.message == "Flush cache failed."
    with pytest.raises(EngineRejected) as info:
        await engine.flush_cache(0.02)
    assert info.value.status == 400 and info.value.message == "Timed out waiting for idle state."
    assert not engine.dead
    await engine.continue_generation()
    results = await gather(tasks)
    assert [len(r["output_ids"]) for r in results] == [50, 50]
    assert all(r["meta_info"]["num_retractions"] == 0 for r in results)


@pytest.mark.looptime
@pytest.mark.parametrize("mode", [PauseMode.ABORT, PauseMode.RETRACT, PauseMode.IN_PLACE])
async def test_generate_while_paused_waits_and_completes_after_continue(
    make_engine: MakeEngine, mode: PauseMode
) -> None:
    engine = make_engine()
    await engine.pause_generation(mode)
    task = submit(engine, 5)
    await until(lambda: engine.stats()["submitted"] == 1, what="the request to arrive")
    await asyncio.sleep(0.02)  # virtual: time for 20 steps, four times what it needs
    assert not task.done()
    # Held by the front end, not queued in the scheduler.
    assert engine.stats()["held"] == 1 and engine.stats()["waiting"] == 0
    assert engine.stats()["tokens"] == 0
    await engine.continue_generation()
    (result,) = await gather([task])
    assert finish_type(result) == "length" and len(result["output_ids"]) == 5


@pytest.mark.looptime
async def test_a_wait_pause_is_refused_as_sglang_refuses_it_and_the_requests_run_on(
    make_engine: MakeEngine,
) -> None:
    # SGLang has no wait mode (the library's SGLang client drains with a flush instead).
    engine = make_engine()
    task = submit(engine, 30)
    await until(lambda: engine.stats()["running"] == 1, what="the request to run")
    with pytest.raises(
        EngineRejected, match=r"unknown mode .*'wait'.*valid: abort, retract, in_place"
    ):
        await engine.pause_generation(PauseMode.WAIT)
    assert not engine.paused
    (result,) = await gather([task])
    assert finish_type(result) == "length" and result["meta_info"]["num_retractions"] == 0


@pytest.mark.looptime
@pytest.mark.parametrize("mode", [PauseMode.RETRACT, PauseMode.IN_PLACE])
async def test_no_token_is_produced_while_paused(make_engine: MakeEngine, mode: PauseMode) -> None:
    engine = make_engine()
    tasks = [submit(engine, 500, prompt=(i,)) for i in range(3)]
    await until(lambda: engine.stats()["tokens"] >= 6)
    await engine.pause_generation(mode)
    at_pause = engine.stats()
    await asyncio.sleep(0.03)  # virtual: 30 steps' worth of time, whatever the machine's speed
    after = engine.stats()
    assert (after["tokens"], after["steps"]) == (at_pause["tokens"], at_pause["steps"])
    await engine.pause_generation(PauseMode.ABORT)
    results = await gather(tasks)
    assert sum(len(r["output_ids"]) for r in results) == at_pause["tokens"]


async def test_repeated_pause_and_continue_are_harmless(make_engine: MakeEngine) -> None:
    engine = make_engine()
    task = submit(engine, 30)
    await until(lambda: engine.stats()["tokens"] >= 3)
    for _ in range(2):
        await engine.pause_generation(PauseMode.RETRACT)
    for _ in range(2):
        await engine.continue_generation()
    (result,) = await gather([task])
    assert len(result["output_ids"]) == 30 and not engine.dead
    assert result["meta_info"]["num_retractions"] == 1


# ------------------------------------------------------------------ flush


async def test_flush_is_rejected_while_busy_then_accepted_once_idle(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    await gather([submit(engine, 2, prompt=(7,))])
    task = submit(engine, 30)
    await until(lambda: engine.stats()["running"] == 1)
    with pytest.raises(EngineRejected) as info:
        await engine.flush_cache(0.0)
    assert info.value.status == 400
    assert engine.stats()["prefix_cache_size"] == 1  # a rejected flush clears nothing
    await gather([task])
    await engine.flush_cache(0.0)
    assert engine.stats()["prefix_cache_size"] == 0
    assert [h["outcome"] for h in engine.history()] == ["rejected", "ok"]


async def test_flush_with_timeout_waits_for_idleness(make_engine: MakeEngine) -> None:
    engine = make_engine()
    task = submit(engine, 20)
    await until(lambda: engine.stats()["running"] == 1)
    await engine.flush_cache(2.0)
    assert task.done() and finish_type(task.result()) == "length"


@pytest.mark.looptime
async def test_a_second_flush_waits_its_turn_behind_a_deferred_one(make_engine: MakeEngine) -> None:
    engine = make_engine()
    task = submit(engine, 40)
    await until(lambda: engine.stats()["running"] == 1)
    first = asyncio.create_task(engine.flush_cache(2.0))
    await until(lambda: engine.flush_pending, what="the first flush to be deferred")
    assert not first.done()
    assert all(h["op"] != "flush_cache" for h in engine.history())  # only calls that returned
    # The second waits its turn (never "Another flush_cache is already in progress.").
    second = asyncio.create_task(engine.flush_cache(0.0))
    await asyncio.sleep(0.01)  # virtual: 10 of the 40 steps the request needs
    assert not second.done() and not first.done()
    await asyncio.wait_for(asyncio.gather(first, second), 2.0)
    assert task.done()
    flushes = [h["outcome"] for h in engine.history() if h["op"] == "flush_cache"]
    assert flushes == ["ok", "ok"]  # in order of start


async def test_flush_with_a_timeout_after_a_retract_pause_times_out_as_the_queue_counts(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    task = submit(engine, 500)
    await until(lambda: engine.stats()["tokens"] >= 2)
    await engine.pause_generation(PauseMode.RETRACT)
    with pytest.raises(EngineRejected) as info:
        await engine.flush_cache(0.05)
    assert info.value.status == 400
    assert info.value.message == "Timed out waiting for idle state."
    await engine.flush_cache(0.0)  # without a timeout the retracted requests do not count
    assert not task.done() and not engine.dead


async def test_deferred_flush_succeeds_once_a_continued_engine_goes_idle(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    task = submit(engine, 20)
    await until(lambda: engine.stats()["tokens"] >= 2)
    await engine.pause_generation(PauseMode.RETRACT)
    flush = asyncio.create_task(engine.flush_cache(5.0))
    await until(lambda: engine.flush_pending)
    await engine.continue_generation()
    await asyncio.wait_for(flush, 5.0)
    assert task.done() and finish_type(task.result()) == "length"


# ------------------------------------------------------------------ fatal misuse


async def test_release_during_in_place_pause_with_live_requests_kills_engine(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    tasks = [submit(engine, 1000, prompt=(i,)) for i in range(2)]
    await until(lambda: engine.stats()["tokens"] >= 2)
    await engine.pause_generation(PauseMode.IN_PLACE)
    with pytest.raises(EngineDead) as info:
        await engine.release_memory_occupation(list(ALL_TAGS))
    assert info.value.op == "release_memory_occupation"
    for task in tasks:  # the connections of in-flight requests drop
        with pytest.raises(EngineDead):
            await asyncio.wait_for(task, 1.0)
    assert engine.history()[-1]["outcome"] == "fatal"
    await assert_dead_for_good(engine, "not idle")


async def test_release_while_unpaused_with_work_kills_engine(make_engine: MakeEngine) -> None:
    engine = make_engine()
    task = submit(engine, 1000)
    await until(lambda: engine.stats()["running"] == 1)
    with pytest.raises(EngineDead):
        await engine.release_memory_occupation([Tag.KV_CACHE])
    with pytest.raises(EngineDead):
        await asyncio.wait_for(task, 1.0)
    await assert_dead_for_good(engine, "not idle")


@pytest.mark.parametrize(
    ("first", "second"),
    # A tag named twice in one call is released once (the contract suite shows it on both
    # servers); a later call that names a released tag among new ones still kills.
    [([Tag.KV_CACHE], [Tag.KV_CACHE]), ([], [Tag.WEIGHTS]), ([Tag.WEIGHTS], ALL_TAGS)],
)
async def test_releasing_a_released_tag_kills_engine(
    make_engine: MakeEngine, first: list[Tag], second: list[Tag] | None
) -> None:
    engine = make_engine()
    await engine.pause_generation(PauseMode.RETRACT)
    await engine.flush_cache(0.0)
    with pytest.raises(EngineDead):
        await engine.release_memory_occupation(first)
        if second is not None:
            await engine.release_memory_occupation(second)
    await assert_dead_for_good(engine, "released twice")


async def test_resume_of_a_tag_that_is_not_released_kills_engine(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    await engine.pause_generation(PauseMode.RETRACT)
    with pytest.raises(EngineDead):
        await engine.resume_memory_occupation([Tag.WEIGHTS])
    await assert_dead_for_good(engine, "'weights', which is not released")


async def test_resume_of_all_tags_after_releasing_only_kv_kills_engine(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    await drained_and_released(engine, [Tag.KV_CACHE])
    with pytest.raises(EngineDead):
        await engine.resume_memory_occupation([])  # empty means all three
    assert engine.history()[-1]["tags"] == ["weights", "kv_cache", "cuda_graph"]
    assert engine.history()[-1]["outcome"] == "fatal"
    # cuda_graph is resumed first and it was never released.
    await assert_dead_for_good(engine, "'cuda_graph', which is not released")


@pytest.mark.parametrize("released", [[Tag.KV_CACHE], [Tag.WEIGHTS], list(ALL_TAGS)])
async def test_continue_with_released_memory_and_a_waiting_request_kills_engine(
    make_engine: MakeEngine, released: list[Tag]
) -> None:
    engine = make_engine()
    task = submit(engine, 1000)
    await until(lambda: engine.stats()["tokens"] >= 2)
    await drained_and_released(engine, released)
    await engine.continue_generation()  # answers 200; the next forward pass crashes
    with pytest.raises(EngineDead):
        await asyncio.wait_for(task, 1.0)
    await assert_dead_for_good(engine, "illegal memory access")


async def test_forward_pass_after_a_weights_only_resume_kills_engine(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    await drained_and_released(engine)
    await engine.resume_memory_occupation([Tag.WEIGHTS])
    await engine.continue_generation()
    assert not engine.dead  # no traffic, no forward pass yet
    with pytest.raises(EngineDead):
        await asyncio.wait_for(engine.generate({"input_ids": [5]}), 1.0)
    await assert_dead_for_good(engine, "kv_cache released")


async def test_data_parallel_dummy_batch_kills_an_idle_engine_on_released_memory(
    make_engine: MakeEngine,
) -> None:
    quiet = make_engine(label="quiet")
    dummy = make_engine(label="dummy", dp_dummy_batches=True)
    for engine in (quiet, dummy):
        await drained_and_released(engine)
        await engine.continue_generation()
    await until(lambda: dummy.dead)
    assert not quiet.dead  # without dummy batches an idle engine runs nothing
    assert quiet.stats()["steps"] == quiet.stats()["dummy_steps"] == 0
    await assert_dead_for_good(dummy, "dummy batch")


async def test_dummy_batches_kill_an_unpaused_idle_engine_after_release(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine(dp_dummy_batches=True)
    await engine.server_info()  # the simulated scheduler starts on the first call
    await until(lambda: engine.stats()["dummy_steps"] >= 2 or engine.dead)
    # Release is allowed (the engine is idle), but it keeps running dummy batches.
    await engine.release_memory_occupation([Tag.CUDA_GRAPH, Tag.KV_CACHE])
    await until(lambda: engine.dead)
    await assert_dead_for_good(engine, "illegal memory access")


@pytest.mark.parametrize("source", ["disk", "tensor"])
async def test_writing_weights_while_weights_are_released_kills_engine(
    make_engine: MakeEngine, source: str
) -> None:
    engine = make_engine()
    await drained_and_released(engine)
    with pytest.raises(EngineDead) as info:
        if source == "disk":
            await engine.update_weights_from_disk(
                "/m", weight_version="1", flush_cache=False, abort_all_requests=False
            )
        else:
            await engine.begin_weight_update()
            await engine.update_weights_from_tensor(
                b"w", weight_version="1", flush_cache=False, abort_all_requests=False
            )
    assert info.value.op.startswith("update_weights_from_")
    assert engine.history()[-1]["outcome"] == "fatal"
    await assert_dead_for_good(engine, "'weights' is released")


async def test_resume_beyond_free_gpu_memory_kills_engine(make_engine: MakeEngine) -> None:
    engine = make_engine(gpu_memory_bytes=80 * GIB)
    await drained_and_released(engine)
    engine.set_external_memory(70 * GIB)  # the trainer still holds its state
    await engine.resume_memory_occupation([Tag.CUDA_GRAPH])  # 2 GiB fits
    with pytest.raises(EngineDead):
        await engine.resume_memory_occupation([Tag.WEIGHTS])  # 16 GiB does not
    await assert_dead_for_good(engine, "out of memory")


async def test_health_while_paused_answers_503_after_timeout_and_marks_unhealthy(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine(health_timeout=0.05)
    await engine.health()
    assert await engine.ready()
    await engine.pause_generation(PauseMode.RETRACT)
    start = time.monotonic()
    with pytest.raises(EngineRejected) as info:
        await asyncio.wait_for(engine.health(), 2.0)
    assert time.monotonic() - start >= 0.05
    assert info.value.status == 503
    assert engine.stats()["in_flight"] == 0  # the probe does not linger in the queue
    await engine.continue_generation()
    assert not await engine.ready()  # unhealthy until a health check succeeds
    await engine.health()
    assert await engine.ready()


async def test_close_drops_in_flight_generates_and_is_idempotent(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    task = submit(engine, 10_000)
    await until(lambda: engine.stats()["running"] == 1)
    await engine.close()
    await engine.close()
    with pytest.raises(EngineDead):
        await asyncio.wait_for(task, 1.0)
    with pytest.raises(EngineDead, match="closed"):
        await engine.server_info()
    assert not engine.dead  # closing is not a death


# ------------------------------------------------------------------ memory


async def test_memory_is_accounted_per_tag_across_release_and_resume(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine(memory_bytes={"weights": 100, "kv_cache": 200, "cuda_graph": 30})
    full = {"weights": 100, "kv_cache": 200, "cuda_graph": 30}
    assert engine.memory() == full
    await gather([submit(engine, 2)])
    await drained_and_released(engine, [Tag.WEIGHTS, Tag.CUDA_GRAPH])
    assert engine.memory() == {"weights": 0, "kv_cache": 200, "cuda_graph": 0}
    assert engine.stats()["prefix_cache_size"] == 0  # flushed by the barrier
    assert engine.released_tags == ["weights", "cuda_graph"]
    await engine.release_memory_occupation([Tag.KV_CACHE])
    assert engine.memory() == {"weights": 0, "kv_cache": 0, "cuda_graph": 0}
    await engine.resume_memory_occupation([Tag.WEIGHTS])
    assert engine.memory() == {"weights": 100, "kv_cache": 0, "cuda_graph": 0}
    await engine.resume_memory_occupation([Tag.KV_CACHE, Tag.CUDA_GRAPH])
    assert engine.memory() == full
    assert engine.released_tags == []


async def test_releasing_kv_cache_clears_the_prefix_cache(make_engine: MakeEngine) -> None:
    engine = make_engine()
    await gather([submit(engine, 2)])
    await engine.pause_generation(PauseMode.RETRACT)
    assert engine.stats()["prefix_cache_size"] == 1
    await engine.release_memory_occupation([Tag.KV_CACHE])
    assert engine.stats()["prefix_cache_size"] == 0


async def test_unknown_tag_strings_are_accepted_and_free_nothing(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    await engine.pause_generation(PauseMode.RETRACT)
    before = engine.memory()
    await engine.release_memory_occupation(["weight", "kvcache"])
    assert engine.memory() == before
    assert engine.released_tags == []
    await engine.resume_memory_occupation(["graphs"])
    assert not engine.dead
    with pytest.raises(EngineRejected):  # a bare string is not a list of tags: 400
        await engine.release_memory_occupation("weights")
    assert engine.memory() == before and not engine.dead


async def test_weights_hold_garbage_after_resume_without_cpu_backup(
    make_engine: MakeEngine,
) -> None:
    plain = make_engine(label="plain")
    backed = make_engine(label="backed", weights_cpu_backup=True)
    (reference,) = await gather([submit(backed, 6)])
    for engine in (plain, backed):
        await drained_and_released(engine)
        await engine.resume_memory_occupation([])
        await engine.continue_generation()
    assert not plain.weights_valid and backed.weights_valid
    (garbage,) = await gather([submit(plain, 6)])
    assert garbage["output_ids"] != reference["output_ids"]
    await plain.update_weights_from_disk(
        "/m", weight_version=None, flush_cache=True, abort_all_requests=False
    )
    assert plain.weights_valid
    (good,) = await gather([submit(plain, 6)])
    assert good["output_ids"] == reference["output_ids"]


# ------------------------------------------------------------------ weights


async def test_update_weight_version_by_default_aborts_retracted_requests(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    tasks = [submit(engine, 1000, prompt=(i,)) for i in range(3)]
    await until(lambda: engine.stats()["tokens"] >= 6)
    await engine.pause_generation(PauseMode.RETRACT)
    await engine.update_weight_version("1")
    assert all(t.done() for t in tasks)
    for result in await gather(tasks):
        assert finish_type(result) == "abort" and 0 < len(result["output_ids"]) < 1000
    assert await engine.weight_version() == "1"


async def test_update_weight_version_without_abort_keeps_retracted_requests(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    tasks = [submit(engine, 30, prompt=(i,)) for i in range(3)]
    await until(lambda: engine.stats()["tokens"] >= 6)
    await engine.pause_generation(PauseMode.RETRACT)
    await engine.update_weight_version("1", abort_all_requests=False)
    assert not any(t.done() for t in tasks)
    await engine.continue_generation()
    for result in await gather(tasks):
        assert finish_type(result) == "length" and len(result["output_ids"]) == 30
        assert result["meta_info"]["weight_version"] == "1"
        spans = result["meta_info"]["weight_versions"]
        assert [s["version"] for s in spans] == ["default", "1"]
        assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
        assert spans[1]["end"] == 30


async def test_update_flush_after_a_retract_pause_succeeds_as_the_waiting_queue_is_ignored(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    task = submit(engine, 30)
    await until(lambda: engine.stats()["tokens"] >= 2)
    await engine.pause_generation(PauseMode.RETRACT)
    await engine.update_weights_from_disk(
        "/m", weight_version="2", flush_cache=True, abort_all_requests=False
    )
    assert await engine.weight_version() == "2"
    assert engine.stats()["prefix_cache_size"] == 0 and not task.done()
    await engine.continue_generation()
    (result,) = await gather([task])
    assert result["meta_info"]["weight_version"] == "2"


async def test_update_whose_flush_fails_writes_weights_but_model_info_keeps_its_version(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    task = submit(engine, 30)
    await until(lambda: engine.stats()["tokens"] >= 2)
    await engine.pause_generation(PauseMode.IN_PLACE)  # requests keep running: no flush
    with pytest.raises(EngineRejected) as info:
        await engine.update_weights_from_disk(
            "/m", weight_version="2", flush_cache=True, abort_all_requests=False
        )
    assert info.value.status == 400 and info.value.message.startswith("Weights were updated")
    assert await engine.weight_version() == "default"  # only a whole success moves it
    assert not engine.dead and not task.done()
    await engine.continue_generation()
    (result,) = await gather([task])
    # The scheduler's version moved with the weights: the tokens after it carry "2".
    assert [s["version"] for s in result["meta_info"]["weight_versions"]] == ["default", "2"]
    assert engine.stats()["prefix_cache_size"] == 1
    await engine.update_weights_from_disk(
        "/m", weight_version="3", flush_cache=True, abort_all_requests=False
    )
    assert engine.stats()["prefix_cache_size"] == 0
    assert await engine.weight_version() == "3"


async def test_update_on_an_unpaused_engine_waits_for_running_requests(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    task = submit(engine, 25)
    await until(lambda: engine.stats()["running"] == 1)
    await engine.update_weights_from_disk(
        "/m", weight_version="1", flush_cache=False, abort_all_requests=False
    )
    assert task.done()
    assert finish_type(task.result()) == "length"
    assert task.result()["meta_info"]["weight_version"] == "default"


async def test_update_with_abort_all_requests_aborts_in_flight_requests(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    task = submit(engine, 1000)
    await until(lambda: engine.stats()["tokens"] >= 2)
    await engine.update_weights_from_disk(
        "/m", weight_version="1", flush_cache=False, abort_all_requests=True
    )
    assert task.done() and finish_type(task.result()) == "abort"


async def test_tensor_update_needs_a_weight_update_session(make_engine: MakeEngine) -> None:
    engine = make_engine()
    await engine.pause_generation(PauseMode.RETRACT)
    with pytest.raises(EngineRejected) as info:
        await engine.update_weights_from_tensor(
            b"w", weight_version="1", flush_cache=False, abort_all_requests=False
        )
    assert info.value.status == 400
    assert info.value.message == (
        "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
    )
    assert await engine.weight_version() == "default"
    with pytest.raises(EngineRejected, match="no weight-update session is open"):
        await engine.end_weight_update()
    await engine.begin_weight_update()
    with pytest.raises(EngineRejected, match="already open") as again:
        await engine.begin_weight_update()
    assert again.value.status == SESSION_OPEN  # as every backend refuses it
    await engine.update_weights_from_tensor(
        b"w", weight_version="1", flush_cache=False, abort_all_requests=False
    )
    await engine.end_weight_update()
    assert await engine.weight_version() == "1"
    assert not engine.dead


async def test_abort_request_needs_a_live_rid_exactly_and_ignores_an_empty_one(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    tasks = {rid: submit(engine, 500, rid=rid) for rid in ("a-1", "a-2", "b-1")}
    await until(lambda: engine.stats()["running"] == 3)
    await engine.pause_generation(PauseMode.RETRACT)
    await engine.abort_request("a-")  # a prefix names no live request: nothing happens
    await engine.abort_request("")  # an empty rid without abort_all is ignored
    assert not any(t.done() for t in tasks.values())
    await engine.abort_request("a-1")
    assert tasks["a-1"].done() and finish_type(tasks["a-1"].result()) == "abort"
    assert not tasks["a-2"].done() and not tasks["b-1"].done()
    await engine.abort_request(abort_all=True)
    assert all(finish_type(t.result()) == "abort" for t in tasks.values())


async def test_abort_all_does_not_reach_requests_held_in_the_front_end_while_paused(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    await engine.pause_generation(PauseMode.ABORT)
    task = submit(engine, 5)
    await until(lambda: engine.stats()["held"] == 1)
    await engine.abort_request(abort_all=True)
    await engine.update_weight_version("v1")  # its default abort-all does not reach it either
    assert not task.done()
    await engine.continue_generation()
    (result,) = await gather([task])
    assert finish_type(result) == "length"


async def test_safe_colocated_sequence_loses_no_request(make_engine: MakeEngine) -> None:
    engine = make_engine()
    tasks = [submit(engine, 40, prompt=(i,)) for i in range(5)]
    await until(lambda: engine.stats()["tokens"] >= 10)
    await engine.pause_generation(PauseMode.RETRACT)
    await engine.flush_cache(0.0)
    await engine.release_memory_occupation(list(ALL_TAGS))
    assert sum(engine.memory().values()) == 0
    await engine.resume_memory_occupation([Tag.WEIGHTS])
    await engine.begin_weight_update()
    await engine.update_weights_from_tensor(
        b"w", weight_version="1", flush_cache=False, abort_all_requests=False
    )
    await engine.end_weight_update()
    await engine.resume_memory_occupation([Tag.KV_CACHE, Tag.CUDA_GRAPH])
    await engine.continue_generation()
    for result in await gather(tasks):
        assert finish_type(result) == "length" and len(result["output_ids"]) == 40
        assert [s["version"] for s in result["meta_info"]["weight_versions"]] == ["default", "1"]
    assert not engine.dead and engine.stats()["aborted"] == 0


async def test_server_info_has_sglangs_shape_and_memory_measured_at_load(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine(memory_bytes={"weights": 2 * GIB, "kv_cache": 4 * GIB})
    info = await engine.server_info()
    assert {"api_key", "admin_api_key", "version", "launch_command"} <= set(info)
    assert info["weight_version"] == "default"
    (rank,) = info["internal_states"]
    usage = rank["memory_usage"]
    assert (usage["weight"], usage["kvcache"]) == (2.0, 4.0)
    assert isinstance(usage["token_capacity"], int) and isinstance(usage["graph"], dict)
    assert not {"paused", "released_tags", "weights_valid", "healthy"} & set(info)
    await drained_and_released(engine)
    assert (await engine.server_info())["internal_states"][0]["memory_usage"] == usage


async def test_distributed_update_needs_a_session_and_an_initialised_group(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    await engine.pause_generation(PauseMode.RETRACT)

    def update(group: str) -> Awaitable[None]:
        return engine.update_weights_from_distributed(
            ["w"], ["bfloat16"], [[2]], group, weight_version="v1", flush_cache=False,
            abort_all_requests=False, load_format="flattened_bucket",
        )  # fmt: skip

    with pytest.raises(EngineRejected, match="must run between begin_weight_update"):
        await update("g")
    await engine.begin_weight_update()
    with pytest.raises(EngineRejected) as info:
        await update("g")
    assert info.value.message == (
        "Failed to receive weights: Group g not in []. "
        "Please call `init_weights_update_group` first."
    )
    await engine.init_weights_update_group("127.0.0.1", 29500, 1, 2, group_name="g")
    await update("g")
    await engine.end_weight_update()
    assert await engine.weight_version() == "v1"
    await engine.destroy_weights_update_group("g")
    with pytest.raises(EngineRejected, match="does not exist"):
        await engine.destroy_weights_update_group("g")
    assert not engine.dead


async def test_a_draft_selector_loads_nothing_into_a_model_without_a_draft(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    await drained_and_released(engine, [Tag.WEIGHTS])
    await engine.resume_memory_occupation([Tag.WEIGHTS])  # no CPU backup: garbage
    await engine.begin_weight_update(selector="all")
    # SGLang does not compare the update's selector with begin's; "draft" selects no runner.
    await engine.update_weights_from_tensor(
        b"w", weight_version="v1", flush_cache=False, abort_all_requests=False, selector="draft"
    )
    assert not engine.weights_valid and await engine.weight_version() == "v1"
    await engine.update_weights_from_tensor(
        b"w", weight_version="v2", flush_cache=False, abort_all_requests=False
    )
    await engine.end_weight_update()
    assert engine.weights_valid


async def test_begin_weight_update_on_an_unpaused_engine_waits_for_running_requests(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    task = submit(engine, 25)
    await until(lambda: engine.stats()["running"] == 1)
    await engine.begin_weight_update()
    assert task.done() and finish_type(task.result()) == "length"
    await engine.end_weight_update()


# ------------------------------------------------------------------ timing, history


async def test_op_latency_makes_ops_take_at_least_that_long(make_engine: MakeEngine) -> None:
    engine = make_engine(
        op_latency={"pause_generation": 0.05, "continue_generation": (0.02, 0.04)}, seed=1
    )
    start = time.monotonic()
    pause = asyncio.create_task(engine.pause_generation(PauseMode.RETRACT))
    await until(lambda: engine.state()["in_flight"] == ["pause_generation"], what="the pause")
    assert await engine.ready()  # the effect comes after the delay
    await pause
    assert time.monotonic() - start >= 0.05
    start = time.monotonic()
    await engine.continue_generation()
    assert time.monotonic() - start >= 0.02
    durations = {h["op"]: h["end"] - h["start"] for h in engine.history()}
    assert durations["pause_generation"] >= 0.05
    assert durations["continue_generation"] >= 0.02
    assert durations["ready"] < 0.02


async def test_history_records_ops_in_order_with_outcomes(make_engine: MakeEngine) -> None:
    engine = make_engine()
    await gather([submit(engine, 2)])  # generation is not a lifecycle op: not recorded
    await engine.pause_generation(PauseMode.RETRACT)
    await engine.flush_cache(0.5)
    await engine.begin_weight_update()
    with pytest.raises(EngineRejected):
        await engine.begin_weight_update()
    await engine.end_weight_update()
    with pytest.raises(EngineRejected):
        await engine.update_weights_from_tensor(
            b"w", weight_version="1", flush_cache=False, abort_all_requests=False
        )
    await engine.release_memory_occupation([Tag.KV_CACHE])
    with pytest.raises(EngineDead):
        await engine.release_memory_occupation([Tag.KV_CACHE])
    with pytest.raises(EngineDead):
        await engine.server_info()
    history = engine.history()
    assert [(h["op"], h["outcome"]) for h in history] == [
        ("pause_generation", "ok"),
        ("flush_cache", "ok"),
        ("begin_weight_update", "ok"),
        ("begin_weight_update", "rejected"),
        ("end_weight_update", "ok"),
        ("update_weights_from_tensor", "rejected"),
        ("release_memory_occupation", "ok"),
        ("release_memory_occupation", "fatal"),
        ("server_info", "dead"),
    ]
    assert history[0]["mode"] == "retract"
    assert history[6]["tags"] == ["kv_cache"]
    assert history[5]["version"] == "1"
    assert all(h["start"] <= h["end"] for h in history)
    starts = [h["start"] for h in history]
    assert starts == sorted(starts)
    assert history[7]["detail"] is not None and "released twice" in history[7]["detail"]
    history[0]["op"] = "tampered"
    assert engine.history()[0]["op"] == "pause_generation"  # a copy


async def test_a_long_history_stays_in_order_and_costs_the_collector_nothing(
    make_engine: MakeEngine,
) -> None:
    """Thousands of in-process engines keep millions of entries: old ones must not be objects
    that every full collection walks, and ``history()`` must still give each one, in order."""
    engine = make_engine()

    async def cycles(count: int) -> None:
        for _ in range(count):
            await engine.pause_generation(PauseMode.RETRACT)
            await engine.flush_cache(1.0)
            await engine.release_memory_occupation([Tag.KV_CACHE])
            await engine.resume_memory_occupation([Tag.KV_CACHE.value])
            await engine.continue_generation()

    await cycles(10)
    load = collector_load()
    await cycles(300)  # 1,500 more entries; each one walked would add at least 1,500
    assert collector_load() - load < 500

    history = engine.history()
    assert len(history) == 1550
    ops = [
        "pause_generation",
        "flush_cache",
        "release_memory_occupation",
        "resume_memory_occupation",
        "continue_generation",
    ]
    assert [h["op"] for h in history[:5]] == ops == [h["op"] for h in history[-5:]]
    assert [h["start"] for h in history] == sorted(h["start"] for h in history)
    release = history[2]
    assert release["tags"] == ["kv_cache"] and release["requested_tags"] == ["kv_cache"]
    assert history[3]["requested_tags"] == ["kv_cache"] and history[0]["mode"] == "retract"
    release["tags"].append("changed")  # a copy
    assert engine.history()[2]["tags"] == ["kv_cache"]


@pytest.mark.looptime
async def test_take_history_gives_each_finished_call_once_and_keeps_running_ones(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine(op_latency={"flush_cache": 0.2})
    for _ in range(8):  # 40 entries: some of them archived
        await engine.pause_generation(PauseMode.RETRACT)
        await engine.release_memory_occupation([Tag.KV_CACHE])
        await engine.resume_memory_occupation([Tag.KV_CACHE.value])
        await engine.continue_generation()
        await engine.update_weight_version("1")
    await engine.pause_generation(PauseMode.RETRACT)
    flushing = asyncio.create_task(engine.flush_cache(1.0))
    await until(lambda: engine.state()["in_flight"] == ["flush_cache"], what="the flush to run")

    taken = engine.take_history()
    assert [h["op"] for h in taken] == [h["op"] for h in taken[:5]] * 8 + ["pause_generation"]
    assert engine.history() == []  # the archived entries are gone too

    await asyncio.wait_for(flushing, timeout=5)
    await engine.continue_generation()
    assert [h["op"] for h in engine.take_history()] == ["flush_cache", "continue_generation"]
    assert engine.take_history() == []


@pytest.mark.parametrize("latency", [{}, {"observe": 0.01}], ids=["at once", "with latency"])
async def test_an_observe_is_recorded_and_a_dead_engine_refuses_it_whatever_it_takes(
    make_engine: MakeEngine, latency: dict[str, float]
) -> None:
    # A read without latency takes a path of its own (no coroutine per read): it must record
    # and refuse exactly as one with latency does.
    engine = make_engine(op_latency=latency)
    first = await engine.observe()
    assert first["paused"] is False and isinstance(first["incarnation"], str)
    await engine.pause_generation(PauseMode.RETRACT)
    assert (await engine.observe(identify=False))["paused"] is True
    await engine.flush_cache(0.0)
    await engine.release_memory_occupation([Tag.KV_CACHE])
    with pytest.raises(EngineDead):
        await engine.release_memory_occupation([Tag.KV_CACHE])  # released twice: fatal
    with pytest.raises(EngineDead):
        await engine.observe()
    reads = [e for e in engine.history() if e["op"] == "observe"]
    assert [e["outcome"] for e in reads] == ["ok", "ok", "dead"]
    assert all(e["end"] is not None and e["end"] >= e["start"] for e in reads)
    assert "engine is dead" in reads[-1]["detail"]


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"token_latency": -1}, "-1"),
        ({"token_latency": "fast"}, "'fast'"),
        ({"health_timeout": math.nan}, "nan"),
        ({"op_latency": {"pause": 1.0}}, "'pause'"),
        ({"op_latency": {"flush_cache": -0.5}}, "-0.5"),
        ({"op_latency": {"flush_cache": (1.0, 2.0, 3.0)}}, "(1.0, 2.0, 3.0)"),
        ({"op_latency": {"flush_cache": (0.5, 0.1)}}, "(0.5, 0.1)"),
        ({"op_latency": {"flush_cache": (0.1, "x")}}, "'x'"),
        ({"memory_bytes": {"gpu": 1}}, "'gpu'"),
        ({"memory_bytes": {"weights": -5}}, "-5"),
        ({"memory_bytes": {"weights": 1.5}}, "1.5"),
        ({"max_running": 0}, "0"),
        ({"label": ""}, "''"),
        ({"seed": "s"}, "'s'"),
        ({"gpu_memory_bytes": -1}, "-1"),
    ],
)
def test_constructor_rejects_bad_arguments_naming_the_value(
    options: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidArgument) as info:
        SimulatedEngine(**options)
    assert named in str(info.value)
    assert isinstance(info.value, ValueError)
