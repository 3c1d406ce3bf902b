"""Weight-update sessions and selectors, updates from disk and the versions ``/model_info``
reports, and ``/update_weight_version`` with and without aborting requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from wire.helpers import Target, finish_type, in_flight

SUCCESS = {"success": True, "message": "Success"}


async def version(client: httpx.AsyncClient) -> str:
    answer = await client.get("/model_info")
    assert answer.status_code == 200
    found: str = answer.json()["weight_version"]
    return found


@pytest.fixture
async def client(target: Target) -> AsyncIterator[httpx.AsyncClient]:
    """A client to the shared server, whose weight version is put back as it was."""
    async with target.client() as client:
        before = await version(client)
        yield client
        await client.post(
            "/update_weight_version", json={"new_version": before, "abort_all_requests": False}
        )


@pytest.mark.parametrize("selector", ["target", "draft", "all", None])
async def test_a_weight_update_session_opens_and_closes_with_each_selector(
    client: httpx.AsyncClient, selector: str | None
) -> None:
    body = {} if selector is None else {"selector": selector}
    begin = await client.post("/begin_weight_update", json=body)
    assert begin.status_code == 200 and begin.json() == SUCCESS
    end = await client.post("/end_weight_update", json={})
    assert end.status_code == 200 and end.json() == SUCCESS


async def test_a_second_begin_is_refused_while_a_session_is_open(
    client: httpx.AsyncClient,
) -> None:
    assert (await client.post("/begin_weight_update", json={"selector": "all"})).status_code == 200
    again = await client.post("/begin_weight_update", json={"selector": "all"})
    assert again.status_code == 400
    assert again.json()["success"] is False and "already open" in again.json()["message"]
    assert (await client.post("/end_weight_update", json={})).status_code == 200


async def test_end_without_an_open_session_is_refused(client: httpx.AsyncClient) -> None:
    answer = await client.post("/end_weight_update", json={})
    assert answer.status_code == 400
    assert (
        answer.json()["success"] is False and "no weight-update session" in answer.json()["message"]
    )


async def test_update_from_disk_sets_the_version_model_info_reports(
    client: httpx.AsyncClient,
) -> None:
    model_path = (await client.get("/model_info")).json()["model_path"]
    answer = await client.post(
        "/update_weights_from_disk",
        json={"model_path": model_path, "weight_version": "disk-v1", "flush_cache": True},
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["success"] is True and isinstance(body["message"], str)
    assert body["num_paused_requests"] == 0
    assert await version(client) == "disk-v1"
    out = await client.post(
        "/generate",
        json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
    )
    assert out.json()["meta_info"]["weight_version"] == "disk-v1"


async def test_failed_update_from_disk_leaves_the_version_unchanged(
    client: httpx.AsyncClient,
) -> None:
    before = await version(client)
    answer = await client.post(
        "/update_weights_from_disk",
        json={"model_path": "/nonexistent/contract-model", "weight_version": "never"},
    )
    assert answer.status_code == 400, answer.text
    body = answer.json()
    assert body["success"] is False and body["message"]
    assert await version(client) == before
    # The server still serves.
    out = await client.post(
        "/generate",
        json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}},
    )
    assert out.status_code == 200 and len(out.json()["output_ids"]) == 3


async def test_update_weight_version_without_abort_keeps_requests_in_flight(
    client: httpx.AsyncClient,
) -> None:
    tasks = await in_flight(client, 2, 60)
    answer = await client.post(
        "/update_weight_version", json={"new_version": "kept-v2", "abort_all_requests": False}
    )
    assert answer.status_code == 200, answer.text
    assert answer.json() == {
        "success": True,
        "message": "Weight version updated to kept-v2",
        "new_version": "kept-v2",
    }
    assert await version(client) == "kept-v2"
    for result in await asyncio.wait_for(asyncio.gather(*tasks), 120):
        assert finish_type(result) == "length" and len(result["output_ids"]) == 60


async def test_update_weight_version_aborts_requests_by_default(
    client: httpx.AsyncClient,
) -> None:
    tasks = await in_flight(client, 2, 200)
    answer = await client.post("/update_weight_version", json={"new_version": "abort-v3"})
    assert answer.status_code == 200, answer.text
    assert await version(client) == "abort-v3"
    for result in await asyncio.wait_for(asyncio.gather(*tasks), 120):
        assert finish_type(result) == "abort"
        assert len(result["output_ids"]) < 200


async def checksums(client: httpx.AsyncClient) -> dict[str, str]:
    answer = await client.post(
        "/weights_checker", json={"action": "checksum", "selector": "target"}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["success"] is True and len(body["per_engine_checksum"]) == 64
    (rank,) = body["ranks"]
    assert rank["parallelism_info"][0]["tp_size"] == 1
    found: dict[str, str] = rank["checksums"]
    return found


@pytest.fixture
def other_checkpoint(
    target: Target, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """A checkpoint with other weights than the served one (for the stand-in any directory)."""
    folder = tmp_path_factory.mktemp("other")
    if target.kind == "standin":
        return str(folder)
    from real.checkpoints import rewrite_weights

    env = request.getfixturevalue("real_sglang")
    return rewrite_weights(
        env, folder, "t['transformer.wpe.weight'] = t['transformer.wpe.weight'] * 2"
    )


async def test_a_checksum_is_a_16_hex_digest_per_tensor_that_moves_only_with_the_weights(
    client: httpx.AsyncClient, other_checkpoint: str
) -> None:
    model_path = (await client.get("/model_info")).json()["model_path"]
    first = await checksums(client)
    assert first and all(len(v) == 16 and int(v, 16) >= 0 for v in first.values())
    assert await checksums(client) == first  # a read changes nothing
    body = {"flush_cache": True, "abort_all_requests": False}
    loaded = await client.post(
        "/update_weights_from_disk", json={"model_path": other_checkpoint, **body}
    )
    assert loaded.status_code == 200, loaded.text
    other = await checksums(client)
    assert other.keys() == first.keys() and other != first
    back = await client.post("/update_weights_from_disk", json={"model_path": model_path, **body})
    assert back.status_code == 200, back.text
    assert await checksums(client) == first  # the same checkpoint: the same digests


async def test_the_checksum_route_takes_no_body_and_refuses_an_action_it_does_not_know(
    client: httpx.AsyncClient,
) -> None:
    """The body is optional: without one (POST or GET) the route runs a checksum. An unknown
    action is the scheduler's 400 ``success: false``; a value of the wrong kind is a validation
    error. Nothing changes either way."""
    first = await checksums(client)
    for method in ("POST", "GET"):
        answer = await client.request(method, "/weights_checker")
        assert answer.status_code == 200, (method, answer.text)
        assert answer.json()["ranks"][0]["checksums"] == first
    unknown = await client.post("/weights_checker", json={"action": "nope"})
    assert unknown.status_code == 400
    assert unknown.json() == {"success": False, "message": "Unsupported action='nope'"}
    for body in ({"action": 7}, {"selector": "no-such-choice"}):
        wrong = await client.post("/weights_checker", json=body)
        assert wrong.status_code == 400 and wrong.json()["object"] == "error", (body, wrong.text)
    assert await checksums(client) == first
