"""The vLLM stand-in's app in this process (``create_vllm_app`` over a ``SimulatedEngine``): the
answers the contract scenarios do not reach (a wait pause, a level-0 sleep, wakes of tags not
asleep, bad queries, the checksum comparison, the abort of every request, ``/load``), and the
simulated engine's hooks the stand-in uses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from rollout_lifecycle.contract.exceptions import EngineDead, InvalidArgument
from rollout_lifecycle.testing.simulated import SimulatedEngine
from rollout_lifecycle.testing.standin.vllm_app import create_vllm_app
from rollout_lifecycle.testing.waits import until


@pytest.fixture
async def engine() -> AsyncIterator[SimulatedEngine]:
    sim = SimulatedEngine("vllm-app", token_latency=0.002)
    yield sim
    await sim.close()


@pytest.fixture
async def raw(engine: SimulatedEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = create_vllm_app(engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://vllm", timeout=30) as c:
        yield c


def completion(tokens: int, request_id: str | None = None) -> dict[str, object]:
    body: dict[str, object] = {"prompt": [1, 2, 3], "max_tokens": tokens, "return_token_ids": True}
    if request_id is not None:
        body["request_id"] = request_id
    return body


async def test_a_wait_pause_answers_once_the_running_request_has_ended_full_length(
    raw: httpx.AsyncClient, engine: SimulatedEngine
) -> None:
    job = asyncio.ensure_future(raw.post("/v1/completions", json=completion(200)))
    await until(lambda: engine.stats()["running"] == 1, what="the request running")
    assert (await raw.post("/pause", params={"mode": "wait"})).json() == {"status": "paused"}
    # The request had ended at the engine when the pause answered (its answer may still be on
    # its way to the client: that is the transport's, not the pause's).
    assert engine.stats()["in_flight"] == 0
    choice = (await job).json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 200
    assert (await raw.get("/is_paused")).json() == {"is_paused": True}


async def test_a_wait_pause_after_a_keep_pause_drains_the_frozen_request(
    raw: httpx.AsyncClient, engine: SimulatedEngine
) -> None:
    # vllm: pause_scheduler(mode="wait") sets PAUSED_NEW, which steps whatever was frozen.
    job = asyncio.ensure_future(raw.post("/v1/completions", json=completion(200)))
    await until(lambda: engine.stats()["running"] == 1, what="the request running")
    await raw.post("/pause", params={"mode": "keep"})
    answer = await asyncio.wait_for(raw.post("/pause", params={"mode": "wait"}), 60)
    assert answer.json() == {"status": "paused"} and engine.stats()["in_flight"] == 0
    assert len((await job).json()["choices"][0]["token_ids"]) == 200


async def test_a_sleep_after_a_wake_of_the_weights_alone_puts_them_back_to_sleep(
    raw: httpx.AsyncClient, engine: SimulatedEngine
) -> None:
    await raw.post("/sleep", params={"level": 1, "mode": "keep"})
    await raw.post("/wake_up", params={"tags": "weights"})
    assert engine.released_tags == ["kv_cache"]
    # vllm: CuMemAllocator.sleep skips the KV cache, asleep already
    assert (await raw.post("/sleep", params={"level": 1, "mode": "keep"})).status_code == 200
    assert sorted(engine.released_tags) == ["kv_cache", "weights"]
    assert (await raw.post("/wake_up")).json()["status"] == "awake"


async def test_a_finish_with_a_body_that_is_not_an_object_is_a_400(
    raw: httpx.AsyncClient,
) -> None:
    for body in (b"[1, 2]", b"{not json"):
        answer = await raw.post("/finish_weight_update", content=body)
        assert answer.status_code == 400, (body, answer.text)


async def test_a_level_0_sleep_only_pauses_and_a_wake_without_tags_resumes(
    raw: httpx.AsyncClient, engine: SimulatedEngine
) -> None:
    assert (await raw.post("/sleep", params={"level": 0})).json()["level"] == 0
    assert engine.paused and engine.released_tags == []
    metrics = (await raw.get("/metrics")).text
    assert 'sleep_state="awake"} 0.0' in metrics and "process_start_time_seconds " in metrics
    assert (await raw.post("/wake_up")).json() == {"status": "awake", "tags": None}
    assert not engine.paused


async def test_a_wake_of_a_tag_not_asleep_wakes_nothing(
    raw: httpx.AsyncClient, engine: SimulatedEngine
) -> None:
    await raw.post("/sleep", params={"level": 1, "mode": "keep"})
    assert engine.released_tags == ["weights", "kv_cache"]
    answer = await raw.post("/wake_up", params={"tags": ["weights", "cuda_graph"]})
    assert answer.json()["status"] == "sleeping" and engine.released_tags == ["weights", "kv_cache"]
    assert (await raw.post("/wake_up")).json()["status"] == "awake"
    assert engine.released_tags == [] and not engine.paused


async def test_bad_queries_and_bodies_answer_400_in_vllms_error_shape(
    raw: httpx.AsyncClient,
) -> None:
    for answer in (
        await raw.post("/pause", params={"mode": "later"}),
        await raw.post("/sleep", params={"level": 3}),
        await raw.post("/collective_rpc", json={}),
        await raw.post("/v1/completions", json={"prompt": {"no": 1}}),
    ):
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["type"] == "Bad Request"
    unknown = await raw.post("/v1/completions", json={"prompt": [1], "model": "other"})
    assert unknown.status_code == 404 and "does not exist" in unknown.text
    assert unknown.json()["error"]["type"] == "NotFoundError"


async def test_a_checksum_compare_names_the_tensors_that_differ(raw: httpx.AsyncClient) -> None:
    sums = (await raw.post("/weight_checker", json={"action": "checksum"})).json()["checksums"]
    same = await raw.post("/weight_checker", json={"action": "compare", "baseline": sums})
    assert same.json() == {"match": True, "mismatches": []}
    name = sorted(sums)[0]
    other = await raw.post(
        "/weight_checker", json={"action": "compare", "baseline": {**sums, name: "0"}}
    )
    assert other.json() == {"match": False, "mismatches": [name]}


async def test_an_abort_of_every_request_answers_each_with_abort(
    raw: httpx.AsyncClient, engine: SimulatedEngine
) -> None:
    jobs = [
        asyncio.ensure_future(raw.post("/v1/completions", json=completion(5000, f"all-{i}")))
        for i in range(2)
    ]
    await until(lambda: engine.stats()["running"] == 2, what="both requests running")
    assert (await raw.get("/load")).json() == {"server_load": 2}
    assert (await raw.post("/abort_requests", json={})).json() == {
        "status": "aborted",
        "aborted": 2,
    }
    for job in jobs:
        answer = (await job).json()
        assert answer["id"].startswith("cmpl-all-")
        assert answer["choices"][0]["finish_reason"] == "abort"
    assert (await raw.get("/load")).json() == {"server_load": 0}


async def test_the_simulated_engine_dies_on_the_forward_pass_after_a_forward_fault(
    engine: SimulatedEngine,
) -> None:
    with pytest.raises(InvalidArgument, match="reason"):
        engine.set_forward_fault("")
    engine.set_forward_fault("half loaded")
    await engine.pause_generation("retract")
    assert not engine.dead  # nothing ran
    await engine.continue_generation()
    assert not engine.dead  # no request: no forward pass
    with pytest.raises(EngineDead):
        await engine.generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
    assert engine.death_reason is not None and "half loaded" in engine.death_reason


async def test_the_simulated_engine_reports_a_requests_output_so_far(
    engine: SimulatedEngine,
) -> None:
    job = asyncio.ensure_future(
        engine.generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 500}, "rid": "r"})
    )
    await until(lambda: len(engine.output_so_far("r") or []) >= 3, what="three tokens")
    seen = engine.output_so_far("r")
    await engine.abort_request("r")
    answer = await job
    assert engine.output_so_far("r") is None  # no longer in flight
    assert seen and answer["output_ids"][: len(seen)] == seen
