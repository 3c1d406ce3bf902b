"""SGLangHTTPEngine against stand-in SGLang servers on loopback: every call, every fatal row."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
import ray

from rollout_lifecycle import (
    EngineDead,
    EngineGroup,
    EngineRejected,
    EngineUnreachable,
    IllegalEngineOp,
    InvalidArgument,
    PauseMode,
    RolloutServer,
    SGLangHTTPEngine,
    Tag,
    launched_sglang_factory,
    start_engine_actor,
)
from rollout_lifecycle.testing import until
from rollout_lifecycle.testing.fleets import pickled_tensors
from rollout_lifecycle.testing.standin import StandInServer

KEY = "contract-admin-key-91c7"


@pytest.fixture
async def live() -> AsyncIterator[tuple[StandInServer, SGLangHTTPEngine]]:
    server = await asyncio.to_thread(StandInServer(admin_key=KEY, token_latency=0.003).start)
    engine = SGLangHTTPEngine(server.url, admin_key=KEY, retries=1)
    yield server, engine
    await engine.close()
    server.stop()


def request(tokens: int, i: int = 0) -> dict[str, Any]:
    return {"input_ids": [i, 3, 5], "sampling_params": {"max_new_tokens": tokens}}


async def until_decoding(engine: SGLangHTTPEngine) -> None:
    """Until the stand-in behind ``engine`` decodes a request (its scheduler runs one)."""
    async with httpx.AsyncClient(base_url=engine.url, trust_env=False) as client:

        async def decoding() -> bool:
            stats: dict[str, int] = (await client.get("/_standin/stats")).json()
            return stats["running"] >= 1

        await until(decoding, what=f"a request to decode on {engine.url}")


async def test_every_lifecycle_call_round_trips(
    live: tuple[StandInServer, SGLangHTTPEngine],
) -> None:
    server, engine = live
    info = await engine.server_info()
    assert info["version"] and await engine.ready()
    assert await engine.weight_version() == "default"
    out = await engine.generate(request(5))
    assert len(out["output_ids"]) == 5 and out["meta_info"]["finish_reason"]["type"] == "length"

    await engine.pause_generation(PauseMode.RETRACT)
    assert not await engine.ready()  # /ready is 503 while paused
    await engine.flush_cache(0.0)
    await engine.release_memory_occupation([Tag.KV_CACHE, Tag.WEIGHTS, Tag.CUDA_GRAPH])
    assert sorted((await asyncio.to_thread(server.state))["released_tags"]) == [
        "cuda_graph",
        "kv_cache",
        "weights",
    ]
    await engine.resume_memory_occupation([Tag.WEIGHTS])
    await engine.begin_weight_update()
    await engine.update_weights_from_disk(
        "/ckpt/1", weight_version="v1", flush_cache=False, abort_all_requests=False
    )
    await engine.update_weights_from_tensor(
        pickled_tensors("w"), weight_version="v2", flush_cache=False, abort_all_requests=False
    )
    await engine.init_weights_update_group("127.0.0.1", 29500, 1, 2, group_name="g0")
    await engine.update_weights_from_distributed(
        ["w"], ["bfloat16"], [[2, 2]], "g0", weight_version="v3", flush_cache=False,
        abort_all_requests=False,
    )  # fmt: skip
    await engine.destroy_weights_update_group("g0")
    await engine.end_weight_update()
    await engine.update_weight_version("v4", abort_all_requests=False)
    assert await engine.weight_version() == "v4"
    await engine.resume_memory_occupation([Tag.KV_CACHE, Tag.CUDA_GRAPH])
    await engine.continue_generation()
    out = await engine.generate(request(4))
    assert out["meta_info"]["weight_version"] == "v4"
    await engine.abort_request("no-such-request")


async def test_weight_calls_outside_a_session_are_rejected_not_fatal(
    live: tuple[StandInServer, SGLangHTTPEngine],
) -> None:
    server, engine = live
    with pytest.raises(EngineRejected) as err:
        await engine.update_weights_from_tensor(
            pickled_tensors("w"), weight_version=None, flush_cache=False, abort_all_requests=False
        )
    assert err.value.status == 400
    with pytest.raises(EngineRejected):
        await engine.end_weight_update()
    assert server.alive()


async def test_flush_answers_400_while_requests_hold_kv_under_in_place(
    live: tuple[StandInServer, SGLangHTTPEngine],
) -> None:
    server, engine = live
    task = asyncio.ensure_future(engine.generate(request(400)))
    await until_decoding(engine)
    await engine.pause_generation(PauseMode.IN_PLACE)
    with pytest.raises(EngineRejected) as err:
        await engine.flush_cache(0.2)
    assert err.value.status == 400
    await engine.continue_generation()
    assert len((await asyncio.wait_for(task, 30))["output_ids"]) == 400
    assert server.alive()


async def test_version_bump_keeps_retracted_requests_because_the_flag_is_explicit(
    live: tuple[StandInServer, SGLangHTTPEngine],
) -> None:
    _, engine = live
    task = asyncio.ensure_future(engine.generate(request(300)))
    await until_decoding(engine)
    await engine.pause_generation(PauseMode.RETRACT)
    await engine.update_weight_version("v9", abort_all_requests=False)
    await engine.continue_generation()
    out = await asyncio.wait_for(task, 30)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["num_retractions"] >= 1


async def test_an_empty_tag_list_is_refused_before_it_is_sent(
    live: tuple[StandInServer, SGLangHTTPEngine],
) -> None:
    server, engine = live
    with pytest.raises(InvalidArgument):
        await engine.resume_memory_occupation([])  # SGLang reads [] as "all three"
    assert server.alive()


async def paused_idle(engine: SGLangHTTPEngine) -> None:
    await engine.pause_generation(PauseMode.RETRACT)
    await engine.flush_cache(0.0)


async def release_busy(engine: SGLangHTTPEngine) -> None:
    task = asyncio.ensure_future(engine.generate(request(500)))
    await until_decoding(engine)
    try:
        await engine.release_memory_occupation([Tag.KV_CACHE])
    finally:
        task.cancel()


async def release_twice(engine: SGLangHTTPEngine) -> None:
    await paused_idle(engine)
    await engine.release_memory_occupation([Tag.KV_CACHE])
    await engine.release_memory_occupation([Tag.KV_CACHE])


async def resume_unreleased(engine: SGLangHTTPEngine) -> None:
    await paused_idle(engine)
    await engine.release_memory_occupation([Tag.KV_CACHE])
    await engine.resume_memory_occupation([Tag.KV_CACHE, Tag.WEIGHTS, Tag.CUDA_GRAPH])


async def generate_on_released(engine: SGLangHTTPEngine) -> None:
    await paused_idle(engine)
    await engine.release_memory_occupation([Tag.KV_CACHE])
    await engine.continue_generation()
    await engine.generate(request(3))


async def write_released_weights(engine: SGLangHTTPEngine) -> None:
    await paused_idle(engine)
    await engine.release_memory_occupation([Tag.WEIGHTS])
    await engine.update_weights_from_disk(
        "/ckpt", weight_version="v1", flush_cache=False, abort_all_requests=False
    )


FATAL: dict[str, Callable[[SGLangHTTPEngine], Awaitable[None]]] = {
    "release while busy": release_busy,
    "double release": release_twice,
    "resume of a tag not released": resume_unreleased,
    "generation on released memory": generate_on_released,
    "weights written while released": write_released_weights,
}


@pytest.mark.parametrize("row", list(FATAL))
async def test_without_the_guard_each_fatal_misuse_kills_the_server(
    row: str, live: tuple[StandInServer, SGLangHTTPEngine]
) -> None:
    server, engine = live
    with pytest.raises((EngineUnreachable, EngineDead)):
        await asyncio.wait_for(FATAL[row](engine), timeout=20)
    assert await asyncio.to_thread(server.wait_dead, 10)
    with pytest.raises(EngineDead):
        await engine.server_info()  # the listener is gone: connection refused


async def test_through_the_guard_each_fatal_misuse_is_refused_and_the_server_lives(
    live: tuple[StandInServer, SGLangHTTPEngine],
) -> None:
    server, engine = live
    group = EngineGroup("actor", [engine])
    rollout = RolloutServer([group])
    with pytest.raises(IllegalEngineOp, match="not paused"):
        group.release_memory([Tag.KV_CACHE])  # release while busy
    with pytest.raises(IllegalEngineOp, match="not released"):
        group.resume_memory([Tag.KV_CACHE])  # resume of a tag not released
    await rollout.offload()
    with pytest.raises(IllegalEngineOp, match="already released"):
        group.release_memory([Tag.KV_CACHE])  # double release
    with pytest.raises(IllegalEngineOp, match="weights are released"):
        group.update_weight_version("v1")  # weights written while released
    await rollout.onload_weights()
    with pytest.raises(IllegalEngineOp, match="kv_cache"):
        group.continue_generation()  # generation on released memory
    await rollout.onload_kv()
    out = await engine.generate(request(3))
    assert len(out["output_ids"]) == 3
    assert server.alive()


async def test_launched_engine_actor_runs_a_cycle_and_stops_its_server(
    ray_cluster: None, unused_tcp_port: int
) -> None:
    command = [
        sys.executable,
        "-m",
        "rollout_lifecycle.cli",
        "fake-sglang",
        "--port",
        str(unused_tcp_port),
        "--admin-key-env",
        "ROLLOUT_LIFECYCLE_ADMIN_API_KEY",
    ]
    factory = launched_sglang_factory(
        "simulated/model", port=unused_tcp_port, command=command, admin_key=KEY,
        startup_timeout=120.0,
    )  # fmt: skip
    actor = start_engine_actor(factory)
    try:
        server = RolloutServer([EngineGroup("actor", [actor])])
        await asyncio.wait_for(server.offload(), timeout=90)
        await asyncio.wait_for(server.onload(), timeout=30)
        probe = SGLangHTTPEngine(f"http://127.0.0.1:{unused_tcp_port}", retries=0)
        assert await probe.ready()  # continued: /ready answers 200 again
        await actor.close.remote()
        with pytest.raises(EngineDead):
            await probe.server_info()  # the child server was terminated with the engine
        await probe.close()
    finally:
        ray.kill(actor)


async def test_server_info_from_a_server_that_publishes_its_keys_reaches_callers_masked() -> None:
    # The stand-in, like SGLang's build_server_info, puts both keys in /server_info in clear.
    api = "contract-api-key-3f0d"
    server = await asyncio.to_thread(StandInServer(admin_key=KEY, api_key=api).start)
    engine = SGLangHTTPEngine(server.url, admin_key=KEY, api_key=api, retries=1)
    try:
        info = await engine.server_info()
        assert info["internal_states"] and "api_key" in info
        assert KEY not in repr(info) and api not in repr(info)
    finally:
        await engine.close()
        server.stop()
