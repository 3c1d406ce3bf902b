"""Release and resume by tags, the safe sequence end to end (on the real server also with two
data-parallel ranks: ``cycle_target``), and the fatal misuses: those a CPU server shows (on a
disposable server), and those only the stand-in can show."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
from wire.helpers import STANDIN_TOKEN_LATENCY, Target, finish_type, gen_request, in_flight

from rollout_lifecycle import PauseMode, SGLangHTTPEngine, Tag
from rollout_lifecycle.testing.standin import StandInServer

ALL_TAGS = ["kv_cache", "weights", "cuda_graph"]
#: A server that dies does so at once; this only bounds the wait.
EXIT_DEADLINE = 90.0


async def post_ok(client: httpx.AsyncClient, path: str, body: object) -> httpx.Response:
    answer = await client.post(path, json=body)
    assert answer.status_code == 200, f"{path}: {answer.status_code} {answer.text}"
    return answer


async def test_release_and_resume_by_tags_answer_null_and_the_server_serves_after(
    cycle_target: Target,
) -> None:
    async with cycle_target.client() as client:
        await post_ok(client, "/pause_generation", {"mode": "retract"})
        for tag in ALL_TAGS:  # one call per tag
            answer = await post_ok(client, "/release_memory_occupation", {"tags": [tag]})
            assert answer.json() is None
        answer = await post_ok(client, "/resume_memory_occupation", {"tags": ["weights"]})
        assert answer.json() is None
        answer = await post_ok(
            client, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}
        )
        assert answer.json() is None
        await post_ok(client, "/continue_generation", {})
        out = await client.post("/generate", json=gen_request(5))
        assert out.status_code == 200 and len(out.json()["output_ids"]) == 5


async def test_a_tag_named_twice_in_one_release_is_released_once(target: Target) -> None:
    async with target.client() as client:
        await post_ok(client, "/pause_generation", {"mode": "retract"})
        dropped = None
        try:
            answer = await client.post(
                "/release_memory_occupation", json={"tags": ["kv_cache", "kv_cache"]}
            )
        except httpx.HTTPError as exc:
            dropped = repr(exc)
        assert dropped is None, f"the server dropped the release: {dropped}"
        assert answer.status_code == 200, answer.text
        await post_ok(client, "/resume_memory_occupation", {"tags": ["kv_cache"]})
        await post_ok(client, "/continue_generation", {})
        out = await client.post("/generate", json=gen_request(3))
        assert out.status_code == 200 and len(out.json()["output_ids"]) == 3


async def test_safe_sequence_through_the_library_keeps_every_request(
    cycle_target: Target,
) -> None:
    """pause(retract) -> flush (no timeout) -> release all -> resume weights -> update from
    disk -> resume kv_cache and cuda_graph -> continue, with requests in flight: every request
    finishes full length, retracted once, its output spanning both weight versions."""
    tokens = 400  # long enough to still be running when the pause lands on a loaded machine
    engine = SGLangHTTPEngine(cycle_target.url, retries=1)
    try:
        async with cycle_target.client() as client:
            model_path = (await client.get("/model_info")).json()["model_path"]
            before = (await client.get("/model_info")).json()["weight_version"]
            tasks = await in_flight(client, 3, tokens)
            await engine.pause_generation(PauseMode.RETRACT)
            await engine.flush_cache(0)
            await engine.release_memory_occupation([Tag.KV_CACHE, Tag.WEIGHTS, Tag.CUDA_GRAPH])
            await engine.resume_memory_occupation([Tag.WEIGHTS])
            await engine.update_weights_from_disk(
                model_path, weight_version="safe-v1", flush_cache=False, abort_all_requests=False
            )
            await engine.resume_memory_occupation([Tag.KV_CACHE, Tag.CUDA_GRAPH])
            await engine.continue_generation()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            assert await engine.weight_version() == "safe-v1"
            for result in results:
                meta = result["meta_info"]
                assert finish_type(result) == "length" and len(result["output_ids"]) == tokens
                assert meta["num_retractions"] >= 1
                spans = meta["weight_versions"]
                assert spans[0]["version"] == before and spans[-1]["version"] == "safe-v1"
                assert spans[0]["start"] == 0 and spans[-1]["end"] == tokens
            await post_ok(
                client,
                "/update_weight_version",
                {"new_version": before, "abort_all_requests": False},
            )
    finally:
        await engine.close()


async def test_release_while_requests_run_kills_the_server(target: Target) -> None:
    """The scheduler asserts idleness (sglang: weight_updater.py
    SchedulerWeightUpdaterManager.release_memory_occupation); the failed assertion ends the
    scheduler, which takes the server down (scheduler.py run_scheduler_process)."""
    doomed = target.disposable()
    async with doomed.client(timeout=60) as client:
        tasks = await in_flight(client, 2, 200)
        with contextlib.suppress(httpx.HTTPError):
            await client.post("/release_memory_occupation", json={"tags": ALL_TAGS})
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert await asyncio.to_thread(doomed.exited, EXIT_DEADLINE)


async def test_resume_of_a_tag_that_is_not_released_kills_the_server(target: Target) -> None:
    """``offload_tags.remove(tag)`` raises KeyError in the scheduler (sglang: weight_updater.py
    SchedulerWeightUpdaterManager.resume_memory_occupation), which takes the server down."""
    doomed = target.disposable()
    async with doomed.client(timeout=60) as client:
        await post_ok(client, "/pause_generation", {"mode": "retract"})
        with contextlib.suppress(httpx.HTTPError):
            await client.post("/resume_memory_occupation", json={"tags": ["weights"]})
    assert await asyncio.to_thread(doomed.exited, EXIT_DEADLINE)


# ------------------------------------------------------------- rows only the stand-in can show
# A CPU server runs without torch_memory_saver (it needs libcuda) and has no GPU memory to run
# out of or to unmap: on it these calls free nothing and so cannot fail.


@pytest.fixture
async def doomed_standin() -> AsyncIterator[StandInServer]:
    server = await asyncio.to_thread(StandInServer(token_latency=STANDIN_TOKEN_LATENCY).start)
    yield server
    server.stop()


async def test_standin_only_second_release_of_a_released_tag_kills_the_server(
    doomed_standin: StandInServer,
) -> None:
    """sglang: weight_updater.py SchedulerWeightUpdaterManager.release_memory_occupation adds
    the tag to a set and calls TorchMemorySaverAdapter.pause (torch_memory_saver_adapter.py
    _TorchMemorySaverAdapterReal.pause) without checking that it is already released;
    torch_memory_saver's tms_pause then fails ("Cannot pause allocation that is not active.")
    and the process exits."""
    async with httpx.AsyncClient(base_url=doomed_standin.url, timeout=30) as client:
        await post_ok(client, "/pause_generation", {"mode": "retract"})
        await post_ok(client, "/release_memory_occupation", {"tags": ["weights"]})
        with contextlib.suppress(httpx.HTTPError):
            await client.post("/release_memory_occupation", json={"tags": ["weights"]})
    assert await asyncio.to_thread(doomed_standin.wait_dead, EXIT_DEADLINE)


async def test_standin_only_out_of_memory_on_resume_kills_the_server() -> None:
    """sglang: weight_updater.py SchedulerWeightUpdaterManager.resume_memory_occupation calls
    TorchMemorySaverAdapter.resume (torch_memory_saver_adapter.py
    _TorchMemorySaverAdapterReal.resume -> tms_resume), which remaps the region's pages; a failed
    allocation there is an exception in the scheduler, and run_scheduler_process (scheduler.py)
    takes the server down."""
    gib = 1 << 30
    memory = {"weights": 1 * gib, "kv_cache": 2 * gib, "cuda_graph": 1 * gib}
    server = await asyncio.to_thread(
        StandInServer(
            token_latency=STANDIN_TOKEN_LATENCY, memory_bytes=memory, gpu_memory_bytes=3 * gib
        ).start
    )
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            await post_ok(client, "/pause_generation", {"mode": "retract"})
            await post_ok(client, "/release_memory_occupation", {"tags": ALL_TAGS})
            await post_ok(client, "/resume_memory_occupation", {"tags": ["weights"]})
            with contextlib.suppress(httpx.HTTPError):
                await client.post(
                    "/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}
                )
        assert await asyncio.to_thread(server.wait_dead, EXIT_DEADLINE)
    finally:
        server.stop()


async def test_standin_only_forward_pass_on_released_memory_kills_the_server(
    doomed_standin: StandInServer,
) -> None:
    """sglang: scheduler.py Scheduler.continue_generation clears the pause without looking at
    the released tags, and Scheduler.event_loop_normal / Scheduler.run_batch run the next
    forward pass on whatever the memory saver unmapped (illegal memory access on a GPU)."""
    async with httpx.AsyncClient(base_url=doomed_standin.url, timeout=30) as client:
        tasks = await in_flight(client, 2, 200)
        await post_ok(client, "/pause_generation", {"mode": "retract"})
        await post_ok(client, "/release_memory_occupation", {"tags": ALL_TAGS})
        with contextlib.suppress(httpx.HTTPError):
            await client.post("/continue_generation", json={})
        # The requests stay open until the death: one given up first would leave no work.
        assert await asyncio.to_thread(doomed_standin.wait_dead, EXIT_DEADLINE)
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            assert isinstance(result, httpx.HTTPError), result  # dropped with the process
