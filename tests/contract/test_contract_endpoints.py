"""Every lifecycle endpoint's answers, success and failure, on an idle server: status codes and
body shapes, a POST with no body, a bad enum value, and the information endpoints."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from contract.helpers import Target

#: SGLang's answer to a request its schema refuses: 400 (not FastAPI's 422) with this shape.
VALIDATION_ERROR_KEYS = {"object", "message", "type", "param", "code"}

#: Every lifecycle endpoint that reads a JSON body.
BODY_ENDPOINTS = [
    "/pause_generation",
    "/continue_generation",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weight_version",
    "/abort_request",
]


def assert_validation_error(answer: httpx.Response) -> None:
    assert answer.status_code == 400, answer.text
    body = answer.json()
    assert set(body) >= VALIDATION_ERROR_KEYS, body
    assert body["object"] == "error" and body["code"] == 400


def assert_ok_status(answer: httpx.Response) -> None:
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert set(body) == {"message", "status"} and body["status"] == "ok", body


@pytest.mark.parametrize("path", BODY_ENDPOINTS)
async def test_post_without_a_body_is_a_400_that_changes_nothing(target: Target, path: str) -> None:
    async with target.client() as client:
        assert_validation_error(await client.post(path))
        # Nothing happened: still serving, nothing released (a generate runs).
        assert (await client.get("/ready")).status_code == 200
        out = await client.post("/generate", json=gen(2))
        assert out.status_code == 200 and len(out.json()["output_ids"]) == 2


def gen(tokens: int) -> dict[str, Any]:
    return {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
    }


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/pause_generation", {"mode": "drain"}),
        ("/begin_weight_update", {"selector": "everything"}),
    ],
)
async def test_bad_enum_value_is_a_400(target: Target, path: str, body: dict[str, Any]) -> None:
    async with target.client() as client:
        assert_validation_error(await client.post(path, json=body))
        assert (await client.get("/ready")).status_code == 200


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_pause_and_continue_answer_ok_on_an_idle_server(target: Target, mode: str) -> None:
    async with target.client() as client:
        assert_ok_status(await client.post("/pause_generation", json={"mode": mode}))
        assert (await client.get("/ready")).status_code == 503
        assert_ok_status(await client.post("/continue_generation", json={}))
        assert (await client.get("/ready")).status_code == 200


async def test_pause_without_mode_defaults_to_abort(target: Target) -> None:
    async with target.client() as client:
        assert_ok_status(await client.post("/pause_generation", json={}))
        assert (await client.get("/ready")).status_code == 503
        assert_ok_status(await client.post("/continue_generation", json={}))


async def test_continue_on_a_server_that_is_not_paused_is_harmless(target: Target) -> None:
    async with target.client() as client:
        assert_ok_status(await client.post("/continue_generation", json={}))
        assert (await client.get("/ready")).status_code == 200


async def test_unknown_body_keys_are_ignored(target: Target) -> None:
    async with target.client() as client:
        answer = await client.post("/pause_generation", json={"mode": "retract", "extra": 1})
        assert_ok_status(answer)
        assert_ok_status(await client.post("/continue_generation", json={"extra": 1}))


async def test_flush_answers_plain_text_on_get_and_post(target: Target) -> None:
    async with target.client() as client:
        for method in ("GET", "POST"):
            answer = await client.request(method, "/flush_cache")
            assert answer.status_code == 200, answer.text
            assert answer.text.startswith("Cache flushed.")
            assert not answer.headers.get("content-type", "").startswith("application/json")


async def test_flush_with_a_negative_timeout_is_a_400(target: Target) -> None:
    async with target.client() as client:
        assert_validation_error(await client.post("/flush_cache", params={"timeout": -1}))


async def test_model_info_carries_the_weight_version_and_model_path(target: Target) -> None:
    async with target.client() as client:
        answer = await client.get("/model_info")
        assert answer.status_code == 200
        info = answer.json()
        assert isinstance(info["weight_version"], str) and info["weight_version"]
        assert isinstance(info["model_path"], str) and info["model_path"]
        assert info["is_generation"] is True


async def test_server_info_has_version_memory_usage_and_keys(keyed: Target) -> None:
    async with keyed.client() as client:
        answer = await client.get("/server_info", headers=keyed.headers(keyed.api_key))
        assert answer.status_code == 200, answer.text
        info = answer.json()
        assert info["version"] == "0.5.23"
        # Published in clear: never log a raw /server_info.
        assert info["api_key"] == keyed.api_key
        assert info["admin_api_key"] == keyed.admin_key
        assert isinstance(info["internal_states"], list) and info["internal_states"]
        usage = info["internal_states"][0]["memory_usage"]
        assert {"weight", "kvcache", "token_capacity", "graph"} <= set(usage), usage
        assert usage["token_capacity"] > 0


async def test_weight_version_is_default_on_a_server_no_update_has_touched(keyed: Target) -> None:
    """The keyed server's weights are never updated by this suite."""
    async with keyed.client() as client:
        answer = await client.get("/model_info", headers=keyed.headers(keyed.api_key))
        assert answer.status_code == 200, answer.text
        assert answer.json()["weight_version"] == "default"
