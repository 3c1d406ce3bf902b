"""Lifecycle endpoints' answers on an idle server: status codes and body shapes, defaults,
unknown keys, and the information endpoints. (Routes, methods, keys and refused bodies of every
endpoint are checked from the endpoint table, in ``test_wire_table``.)"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from wire.helpers import (
    KEEP_ALIVE_S,
    Target,
    finish_type,
    held,
    host_port,
    in_flight,
    stopped,
    through_a_stall,
)

from rollout_lifecycle import SGLangHTTPEngine
from rollout_lifecycle.backends.http.transport import KEEPALIVE_EXPIRY_S
from rollout_lifecycle.testing.waits import until

#: SGLang's answer to a request its schema refuses: 400 (not FastAPI's 422) with this shape.
VALIDATION_ERROR_KEYS = {"object", "message", "type", "param", "code"}


def assert_validation_error(answer: httpx.Response) -> None:
    assert answer.status_code == 400, answer.text
    body = answer.json()
    assert set(body) >= VALIDATION_ERROR_KEYS, body
    assert body["object"] == "error" and body["code"] == 400


def assert_ok_status(answer: httpx.Response) -> None:
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert set(body) == {"message", "status"} and body["status"] == "ok", body


def gen(tokens: int) -> dict[str, Any]:
    return {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
    }


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


async def test_loads_count_the_requests_the_scheduler_holds_until_the_server_is_idle(
    target: Target,
) -> None:
    """``/v1/loads``, which the scenarios wait on instead of on time: it counts each request
    the scheduler holds (``in_flight`` returns once it counts all three, none finished), and
    none once they have finished."""
    async with target.client() as client:
        tasks = await in_flight(client, 3, 200)
        answers = await asyncio.gather(*tasks)
        assert [finish_type(a) for a in answers] == ["length"] * 3

        async def idle() -> bool:
            return await held(client) == 0

        await until(idle, what="the server to hold no request", deadline=60)


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


#: ``GET /ready`` as a raw HTTP/1.1 request.
READY = b"GET /ready HTTP/1.1\r\nhost: server\r\n\r\n"


async def _ask_ready(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """``GET /ready`` on a raw connection: its status line, once the whole answer is read."""
    writer.write(READY)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await asyncio.wait_for(reader.readexactly(length), 60)
    return head.split(b"\r\n")[0]


async def test_the_server_closes_a_connection_left_idle_later_than_the_client_lets_it_go(
    target: Target,
) -> None:
    """SGLang closes a kept-alive connection some seconds after its last answer (uvicorn's
    ``timeout_keep_alive``): the HTTP client's pool lets an idle connection go before that
    (``KEEPALIVE_EXPIRY_S``). (A lower bound: a loaded machine closes later.)"""
    reader, writer = await asyncio.open_connection(*host_port(target))
    try:
        await _ask_ready(reader, writer)
        answered = time.monotonic()
        # the server closes the connection: end of stream, nothing more sent
        assert await asyncio.wait_for(reader.read(), 60) == b""
        idle = time.monotonic() - answered
    finally:
        writer.close()
    print(f"{target.kind}: closed after {idle:.2f} s idle")
    assert idle > KEEPALIVE_EXPIRY_S


async def test_a_stall_past_the_keep_alive_drops_a_call_on_a_kept_connection_not_a_new_one(
    target: Target,
) -> None:
    """Why the HTTP client sends a call it may not repeat on a connection of its own: the server
    arms its keep-alive timer once it has answered, and on uvloop runs a due timer before it
    reads its sockets. A server that stalls past its keep-alive (stopped here; starved on a
    loaded machine) closes a kept connection with the call written onto it unread, and the
    client cannot know whether it ran. A call on a connection opened during the same stall is
    answered."""
    assert target.pid is not None
    kept = await asyncio.open_connection(*host_port(target))
    fresh: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    try:
        assert b" 200 " in await _ask_ready(*kept)
        answered = time.monotonic()
        async with stopped(target.pid):
            kept[1].write(READY)
            await kept[1].drain()
            fresh = await asyncio.open_connection(*host_port(target))  # the kernel accepts it
            fresh[1].write(READY)
            await fresh[1].drain()
            # Stopped, not slowed: past this instant the keep-alive is due on the server's
            # (monotonic) clock, whatever the machine's load.
            await asyncio.sleep(answered + KEEP_ALIVE_S + 0.5 - time.monotonic())
        try:
            dropped = await asyncio.wait_for(kept[0].read(), 60)
        except ConnectionResetError:
            dropped = b""  # closed with the call unread: the kernel resets the connection
        print(f"{target.kind}: the kept connection's call got {dropped!r}")
        assert dropped == b"", "the kept connection answered the call after the stall"
        assert b" 200 " in await asyncio.wait_for(_read_status(fresh[0]), 60)
    finally:
        kept[1].close()
        if fresh is not None:
            fresh[1].close()


async def test_a_call_the_client_may_not_repeat_survives_a_stall_past_the_keep_alive(
    target: Target,
) -> None:
    """The HTTP client's side of the scenario above: a call it sends once (an abort here; a
    release or a resume in a lifecycle step) goes on a connection of its own, so a server that
    stalls past its keep-alive right after answering another call still answers it."""
    engine = SGLangHTTPEngine(target.url)
    try:
        await through_a_stall(target, engine)
    finally:
        await engine.close()


async def _read_status(reader: asyncio.StreamReader) -> bytes:
    return (await reader.readuntil(b"\r\n")).rstrip()
