"""The stand-in SGLang server over real HTTP on loopback: routes, bodies, auth, and its deaths."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_lifecycle.testing import until
from rollout_lifecycle.testing.fleets import pickled_tensors
from rollout_lifecycle.testing.standin import (
    DEATH_EXIT_CODE,
    DEFAULT_STARTUP_TIMEOUT,
    StandInServer,
    auth_level,
    request_allowed,
)

ADMIN_KEY = "adm-standin-5e81c0"
API_KEY = "api-standin-9b27d4"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
API = {"Authorization": f"Bearer {API_KEY}"}
TIMEOUT = httpx.Timeout(10.0)
FATAL_SERVERS = ("busy", "double", "resume", "resume_all", "continue")


@pytest.fixture(scope="module")
def standin_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, StandInServer]]:
    history = tmp_path_factory.mktemp("standin-history")
    servers = {
        "open": StandInServer(
            label="open", token_latency=0.01, health_timeout=0.5, weights_cpu_backup=True
        ),
        "auth": StandInServer(label="auth", admin_key=ADMIN_KEY, api_key=API_KEY),
        "api_only": StandInServer(label="api-only", api_key=API_KEY),
        **{
            name: StandInServer(
                label=f"fatal-{name}", token_latency=0.01, history_file=history / f"{name}.jsonl"
            )
            for name in FATAL_SERVERS
        },
    }
    StandInServer.start_all(servers.values())
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture
def open_url(standin_servers: dict[str, StandInServer]) -> Iterator[str]:
    """The shared open server; every test leaves it serving, unpaused and without requests."""
    url = standin_servers["open"].url
    yield url
    with httpx.Client(timeout=TIMEOUT) as client:
        client.post(f"{url}/abort_request", json={"abort_all": True})
        client.post(f"{url}/continue_generation", json={})


async def wait_running(client: httpx.AsyncClient, url: str, count: int = 1) -> None:
    async def running() -> bool:
        stats = (await client.get(f"{url}/_standin/stats")).json()
        return bool(stats["running"] >= count)

    await until(running, what=f"{count} running request(s)")


def long_generate(client: httpx.AsyncClient, url: str, rid: str, tokens: int = 2000) -> Any:
    return asyncio.ensure_future(
        client.post(
            f"{url}/generate",
            json={
                "input_ids": [3, 1, 4],
                "sampling_params": {"max_new_tokens": tokens},
                "rid": rid,
            },
        )
    )


async def flush_pending(client: httpx.AsyncClient) -> bool:
    return bool((await client.get("/_standin/state")).json()["flush_pending"])


async def one_flush_waits(client: httpx.AsyncClient) -> bool:
    return bool((await client.get("/_standin/state")).json()["flush_waiters"] == 1)


def validation_error(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["object"] == "error" and body["code"] == 400
    message: str = body["message"]
    return message


# --------------------------------------------------------------------------------- routes


def test_ready_line_gives_a_loopback_url_and_a_live_process(
    standin_servers: dict[str, StandInServer],
) -> None:
    server = standin_servers["open"]
    assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
    assert server.alive() and server.pid > 0 and server.returncode is None


def test_pause_and_continue_answer_message_and_status_ok(open_url: str) -> None:
    with httpx.Client(base_url=open_url, timeout=TIMEOUT) as client:
        for body in ({}, {"mode": "abort"}, {"mode": "retract"}, {"mode": "in_place"}):
            paused = client.post("/pause_generation", json=body)
            assert paused.status_code == 200
            assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
        resumed = client.post("/continue_generation", json={"torch_empty_cache": True})
        assert resumed.status_code == 200 and resumed.json()["status"] == "ok"
        assert client.post("/continue_generation", json={}).status_code == 200  # harmless again
        history = client.get("/_standin/history").json()
        modes = [e["mode"] for e in history if e["op"] == "pause_generation"][-4:]
        assert modes == ["abort", "abort", "retract", "in_place"]


BODY_ENDPOINTS = (
    "/pause_generation",
    "/continue_generation",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/update_weight_version",
    "/abort_request",
    "/generate",
)


def test_every_body_endpoint_refuses_a_post_without_body_with_400_field_required(
    open_url: str,
) -> None:
    with httpx.Client(base_url=open_url, timeout=TIMEOUT) as client:
        before = len(client.get("/_standin/history").json())
        for path in BODY_ENDPOINTS:
            assert "Field required" in validation_error(client.post(path)), path
        # GET on release/resume needs the body too; none of these reached the engine.
        assert "Field required" in validation_error(client.get("/release_memory_occupation"))
        assert len(client.get("/_standin/history").json()) == before
        assert client.get("/_standin/memory").json()["kv_cache"] > 0


def test_bad_enum_or_type_is_a_400_json_error_and_unknown_keys_are_ignored(open_url: str) -> None:
    with httpx.Client(base_url=open_url, timeout=TIMEOUT) as client:
        assert "mode" in validation_error(client.post("/pause_generation", json={"mode": "pause"}))
        assert "selector" in validation_error(
            client.post("/begin_weight_update", json={"selector": "both"})
        )
        assert "tags" in validation_error(
            client.post("/release_memory_occupation", json={"tags": "kv_cache"})
        )
        assert "abort_all" in validation_error(
            client.post("/abort_request", json={"abort_all": "yes"})
        )
        assert validation_error(client.post("/pause_generation", content=b"[1, 2]"))
        assert validation_error(client.post("/pause_generation", content=b"{not json"))
        ok = client.post("/pause_generation", json={"mode": "retract", "surprise": [1]})
        assert ok.status_code == 200
        state = client.get("/_standin/state").json()
        assert state["paused"] and state["pause_mode"] == "retract"


def test_flush_cache_get_and_post_answer_plain_text(open_url: str) -> None:
    with httpx.Client(base_url=open_url, timeout=TIMEOUT) as client:
        for method in ("GET", "POST"):
            answer = client.request(method, "/flush_cache")
            assert answer.status_code == 200
            assert answer.headers["content-type"].startswith("text/plain")
            assert "Cache flushed" in answer.text
        assert client.post("/flush_cache", params={"timeout": 0.5}).status_code == 200  # idle
        assert "timeout" in validation_error(client.post("/flush_cache?timeout=soon"))
        # Query(0.0, ge=0.0): a negative timeout fails validation (a JSON 400, not plain text).
        assert "timeout" in validation_error(client.post("/flush_cache", params={"timeout": -1}))


async def test_flush_is_400_plain_text_while_requests_hold_kv_under_in_place_pause(
    open_url: str,
) -> None:
    async with httpx.AsyncClient(base_url=open_url, timeout=TIMEOUT) as client:
        request = long_generate(client, open_url, "frozen-1")
        await wait_running(client, open_url)
        assert (await client.post("/pause_generation", json={"mode": "in_place"})).is_success
        refused = await client.post("/flush_cache")
        assert refused.status_code == 400
        assert refused.headers["content-type"].startswith("text/plain")
        assert refused.text == "Flush cache failed.\n"
        timed_out = await client.post("/flush_cache", params={"timeout": 0.1})
        assert (
            timed_out.status_code == 400 and timed_out.text == "Timed out waiting for idle state."
        )
        # A second flush while one is deferred waits its turn, as SGLang's front end queues
        # flushes; it is never refused as "already in progress".
        waiting = asyncio.ensure_future(client.post("/flush_cache", params={"timeout": 5}))
        await until(lambda: flush_pending(client), what="the first flush to be deferred")
        second = asyncio.ensure_future(client.post("/flush_cache"))
        await until(lambda: one_flush_waits(client), what="the second flush to wait its turn")
        assert not second.done()  # the server holds it: it cannot have been answered
        aborted = await client.post("/abort_request", json={"rid": "frozen-1"})
        assert aborted.status_code == 200 and aborted.content == b""
        result = (await asyncio.wait_for(request, 5)).json()
        assert result["meta_info"]["finish_reason"]["type"] == "abort"
        assert (await asyncio.wait_for(waiting, 5)).status_code == 200  # idle now: flushed
        assert (await asyncio.wait_for(second, 5)).status_code == 200
        assert (await client.post("/continue_generation", json={})).is_success


def test_release_and_resume_answer_null_on_get_and_post_and_accept_unknown_tags(
    open_url: str,
) -> None:
    with httpx.Client(base_url=open_url, timeout=TIMEOUT) as client:
        assert client.post("/pause_generation", json={"mode": "retract"}).is_success
        assert client.post("/flush_cache").status_code == 200
        full = client.get("/_standin/memory").json()
        released = client.post("/release_memory_occupation", json={"tags": None})
        assert released.status_code == 200 and released.content == b"null"
        assert released.json() is None
        assert client.get("/_standin/memory").json() == dict.fromkeys(full, 0)
        state = client.get("/_standin/state").json()
        assert sorted(state["released_tags"]) == ["cuda_graph", "kv_cache", "weights"]
        resumed = client.post("/resume_memory_occupation", json={"tags": []})
        assert resumed.status_code == 200 and resumed.content == b"null"
        assert client.get("/_standin/memory").json() == full
        # GET works too, and a tag SGLang does not know is accepted and frees nothing.
        typo = client.request("GET", "/release_memory_occupation", json={"tags": ["kv-cache"]})
        assert typo.status_code == 200 and typo.content == b"null"
        assert client.get("/_standin/memory").json() == full
        graph = client.request("GET", "/release_memory_occupation", json={"tags": ["cuda_graph"]})
        assert graph.status_code == 200
        back = client.request("GET", "/resume_memory_occupation", json={"tags": ["cuda_graph"]})
        assert back.status_code == 200 and back.content == b"null"
        assert client.get("/_standin/memory").json() == full
        assert client.post("/continue_generation", json={}).is_success
        assert client.get("/health").status_code == 200


def test_weight_update_session_tensor_and_distributed_updates(open_url: str) -> None:
    with httpx.Client(base_url=open_url, timeout=TIMEOUT) as client:
        tensor = {
            "serialized_named_tensors": pickled_tensors("w"),
            "load_format": None,
            "weight_version": "t1",
        }
        outside = client.post("/update_weights_from_tensor", json=tensor)
        assert outside.status_code == 400 and outside.json()["success"] is False
        assert set(outside.json()) == {"success", "message"}
        begun = client.post("/begin_weight_update", json={"selector": "all"})
        assert begun.status_code == 200 and begun.json()["success"] is True
        again = client.post("/begin_weight_update", json={})
        assert again.status_code == 400 and again.json()["success"] is False
        assert "already open" in again.json()["message"]
        updated = client.post("/update_weights_from_tensor", json=tensor)
        assert updated.status_code == 200 and updated.json()["success"] is True
        assert "Field required" in validation_error(
            client.post("/update_weights_from_tensor", json={"flush_cache": False})
        )
        distributed = client.post(
            "/update_weights_from_distributed",
            json={
                "names": ["w"],
                "dtypes": ["bfloat16"],
                "shapes": [[4, 4]],
                "group_name": "g",
                "flush_cache": False,
                "abort_all_requests": False,
                "weight_version": "d1",
            },
        )
        assert distributed.status_code == 400
        assert distributed.json()["message"] == (
            "Failed to receive weights: Group g not in []. "
            "Please call `init_weights_update_group` first."
        )
        group = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1}
        assert "world_size" in validation_error(
            client.post("/init_weights_update_group", json={**group, "group_name": "g"})
        )
        joined = client.post(
            "/init_weights_update_group", json={**group, "world_size": 2, "group_name": "g"}
        )
        assert joined.status_code == 200 and joined.json()["success"] is True
        distributed = client.post(
            "/update_weights_from_distributed",
            json={
                "names": ["w"],
                "dtypes": ["bfloat16"],
                "shapes": [[4, 4]],
                "group_name": "g",
                "load_format": "flattened_bucket",
                "flush_cache": False,
                "abort_all_requests": False,
                "weight_version": "d1",
            },
        )
        assert distributed.status_code == 200 and distributed.json()["success"] is True
        assert client.get("/model_info").json()["weight_version"] == "d1"
        left = client.post("/destroy_weights_update_group", json={"group_name": "g"})
        assert left.status_code == 200 and left.json()["success"] is True
        gone = client.post("/destroy_weights_update_group", json={"group_name": "g"})
        assert gone.status_code == 400
        assert gone.json()["message"] == "The group to be destroyed does not exist."
        ended = client.post("/end_weight_update", json={})
        assert ended.status_code == 200 and ended.json()["success"] is True
        twice = client.post("/end_weight_update", json={})
        assert twice.status_code == 400 and twice.json()["success"] is False


def test_update_weights_from_disk_and_model_info_under_both_names(open_url: str) -> None:
    with httpx.Client(base_url=open_url, timeout=TIMEOUT) as client:
        answer = client.post(
            "/update_weights_from_disk",
            json={
                "model_path": "/ckpt/step-7",
                "load_format": "auto",
                "flush_cache": True,
                "abort_all_requests": False,
                "weight_version": "step-7",
            },
        )
        assert answer.status_code == 200
        body = answer.json()
        assert set(body) == {"success", "message", "num_paused_requests"} and body["success"]
        for path in ("/model_info", "/get_model_info"):
            info = client.get(path).json()
            assert info["weight_version"] == "step-7" and info["model_path"] == "/ckpt/step-7"
        assert "model_path" in validation_error(
            client.post("/update_weights_from_disk", json={"weight_version": "x"})
        )


async def test_update_weight_version_defaults_to_aborting_what_retract_preserved(
    open_url: str,
) -> None:
    async with httpx.AsyncClient(base_url=open_url, timeout=TIMEOUT) as client:
        # abort_all_requests: false keeps the retracted request; it finishes after continue.
        kept = long_generate(client, open_url, "keep-me", tokens=60)
        await wait_running(client, open_url)
        assert (await client.post("/pause_generation", json={"mode": "retract"})).is_success
        answer = await client.post(
            "/update_weight_version", json={"new_version": "v-kept", "abort_all_requests": False}
        )
        assert answer.status_code == 200 and answer.json()["success"] is True
        # Still held by the server (in its waiting queue), so not answered and not aborted.
        assert (await client.get("/_standin/stats")).json()["waiting"] == 1
        assert not kept.done()
        assert (await client.post("/continue_generation", json={})).is_success
        meta = (await asyncio.wait_for(kept, 5)).json()["meta_info"]
        assert meta["finish_reason"]["type"] == "length"
        assert meta["num_retractions"] == 1 and meta["weight_version"] == "v-kept"

        # The default (abort_all_requests true) aborts the request the retract pause preserved.
        lost = long_generate(client, open_url, "lose-me")
        await wait_running(client, open_url)
        assert (await client.post("/pause_generation", json={"mode": "retract"})).is_success
        answer = await client.post("/update_weight_version", json={"new_version": "v-default"})
        assert answer.status_code == 200 and answer.json()["new_version"] == "v-default"
        result = (await asyncio.wait_for(lost, 5)).json()
        assert result["meta_info"]["finish_reason"]["type"] == "abort"
        assert (await client.get("/model_info")).json()["weight_version"] == "v-default"
        assert "new_version" in validation_error(
            await client.post("/update_weight_version", json={})
        )


def test_abort_request_always_answers_200_with_an_empty_body(open_url: str) -> None:
    with httpx.Client(base_url=open_url, timeout=TIMEOUT) as client:
        for body in ({"rid": "no-such-request"}, {"abort_all": True}, {"rid": "x", "y": 1}):
            answer = client.post("/abort_request", json=body)
            assert answer.status_code == 200 and answer.content == b""


def test_health_and_ready_answer_503_while_paused_and_recover(open_url: str) -> None:
    with httpx.Client(base_url=open_url, timeout=TIMEOUT) as client:
        for path in ("/health", "/health_generate", "/ready"):
            answer = client.get(path)
            assert answer.status_code == 200 and answer.content == b"", path
        assert client.post("/pause_generation", json={"mode": "retract"}).is_success
        assert client.get("/ready").status_code == 503
        started = time.monotonic()
        probe = client.get("/health")
        assert probe.status_code == 503 and probe.content == b""
        assert time.monotonic() - started >= 0.4  # it hung for the health timeout first
        assert client.post("/continue_generation", json={}).is_success
        assert client.get("/ready").status_code == 503  # unhealthy until a probe succeeds
        assert client.get("/health_generate").status_code == 200
        assert client.get("/ready").status_code == 200


def test_server_info_under_both_names_reports_memory_and_version(open_url: str) -> None:
    with httpx.Client(base_url=open_url, timeout=TIMEOUT) as client:
        for path in ("/server_info", "/get_server_info"):
            info = client.get(path).json()
            assert info["version"].startswith("0.5.23")
            assert info["api_key"] is None and info["admin_api_key"] is None
            assert info["model_path"] == info["internal_states"][0]["model_path"]
            usage = info["internal_states"][0]["memory_usage"]
            assert {"weight", "kvcache", "token_capacity", "graph"} <= set(usage)
            assert not {"paused", "released_tags", "healthy"} & set(info)


def test_generate_answers_text_output_ids_and_meta_info_on_post_and_put(open_url: str) -> None:
    with httpx.Client(base_url=open_url, timeout=TIMEOUT) as client:
        posted = client.post(
            "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 3}}
        )
        assert posted.status_code == 200
        body = posted.json()
        assert set(body) == {"text", "output_ids", "meta_info"}
        assert len(body["output_ids"]) == 3 and len(body["text"]) == 3
        assert body["meta_info"]["finish_reason"]["type"] == "length"
        meta = body["meta_info"]
        assert meta["weight_versions"] == [
            {"version": meta["weight_version"], "start": 0, "end": 3}
        ]
        assert meta["num_retractions"] == 0
        put = client.put(
            "/generate",
            json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, "rid": "p1"},
        )
        assert put.status_code == 200 and put.json()["meta_info"]["id"] == "p1"
        streamed = client.post("/generate", json={"text": "x", "stream": True})
        assert streamed.status_code == 400 and "stream" in streamed.json()["error"]["message"]
        both = client.post("/generate", json={"text": "x", "input_ids": [1]})
        assert both.status_code == 400 and "error" in both.json()


def test_standin_extras_expose_history_memory_and_stats(open_url: str) -> None:
    with httpx.Client(base_url=open_url, timeout=TIMEOUT) as client:
        history = client.get("/_standin/history").json()
        assert history and {"op", "engine", "start", "end", "outcome"} <= set(history[0])
        memory = client.get("/_standin/memory").json()
        assert set(memory) == {"weights", "kv_cache", "cuda_graph"}
        stats = client.get("/_standin/stats").json()
        assert stats["completed"] >= 1 and stats["running"] == 0


# --------------------------------------------------------------------------------- auth


def test_auth_with_both_keys_wants_admin_for_control_and_api_for_normal(
    standin_servers: dict[str, StandInServer],
) -> None:
    server = standin_servers["auth"]
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        wrong = {"Authorization": "Bearer not-the-key"}
        for path, body in (
            ("/pause_generation", {}),
            ("/flush_cache", None),
            ("/release_memory_occupation", {"tags": ["kv_cache"]}),
            ("/update_weight_version", {"new_version": "x"}),
            ("/abort_request", {"abort_all": True}),
            ("/generate", {"text": "a"}),
        ):
            for headers in ({}, wrong):
                answer = client.post(path, json=body, headers=headers)
                assert answer.status_code == 401 and answer.json() == {"error": "Unauthorized"}
        for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            assert client.get(path).status_code == 401
            assert client.get(path, headers=wrong).status_code == 401
            assert client.get(path, headers=API).status_code == 200
            assert client.get(path, headers=ADMIN).status_code == 401  # normal wants the api key
        # With an admin key configured, the api key no longer opens control endpoints.
        for path in ("/pause_generation", "/continue_generation", "/abort_request"):
            refused = client.post(path, json={}, headers=API)
            assert refused.status_code == 401 and API_KEY not in refused.text
        assert client.post("/pause_generation", json={}, headers=ADMIN).status_code == 200
        assert client.post("/flush_cache", headers=ADMIN).status_code == 200
        assert client.post("/continue_generation", json={}, headers=ADMIN).status_code == 200
        # Probes stay open.
        for path in ("/health", "/health_generate", "/ready"):
            assert client.get(path).status_code == 200, path
        assert client.get("/metrics").status_code != 401
        # Only "Authorization: Bearer" carries a key: X-API-Key is not read at all.
        for headers in ({"X-API-Key": ADMIN_KEY}, {"Authorization": ADMIN_KEY}):
            assert client.post("/pause_generation", json={}, headers=headers).status_code == 401
        assert client.get("/server_info", headers={"X-API-Key": API_KEY}).status_code == 401
        # The weight-group endpoints are control endpoints too.
        for path in ("/init_weights_update_group", "/destroy_weights_update_group"):
            assert client.post(path, json={}, headers=API).status_code == 401
        # /server_info publishes both keys in clear, as SGLang does: the client must mask them.
        info = client.get("/server_info", headers=API).json()
        assert (info["api_key"], info["admin_api_key"]) == (API_KEY, ADMIN_KEY)
    # Keys travel in the environment, never on the command line, and are never printed.
    cmdline = Path(f"/proc/{server.pid}/cmdline")
    if cmdline.exists():
        argv = cmdline.read_bytes().decode()
        assert ADMIN_KEY not in argv and API_KEY not in argv
    assert ADMIN_KEY not in server.stderr_text() and API_KEY not in server.stderr_text()
    assert ADMIN_KEY not in repr(server)


def test_auth_with_only_an_api_key_wants_it_everywhere_but_probes(
    standin_servers: dict[str, StandInServer],
) -> None:
    with httpx.Client(base_url=standin_servers["api_only"].url, timeout=TIMEOUT) as client:
        assert client.post("/pause_generation", json={}).status_code == 401
        assert client.post("/pause_generation", json={}, headers=API).status_code == 200
        assert client.post("/continue_generation", json={}, headers=API).status_code == 200
        assert client.get("/server_info").status_code == 401
        assert client.get("/server_info", headers=API).status_code == 200
        assert client.get("/_standin/stats").status_code == 401
        assert client.get("/health").status_code == 200


def test_auth_decision_table_matches_sglang_levels() -> None:
    assert auth_level("/health_generate") == "open" and auth_level("/ready") == "open"
    assert auth_level("/flush_cache") == "control" and auth_level("/generate") == "normal"
    bearer = "Bearer k-admin"
    # Admin key only: control needs it, normal endpoints are open.
    assert request_allowed("/generate", None, api_key=None, admin_key="k-admin")
    assert not request_allowed("/pause_generation", None, api_key=None, admin_key="k-admin")
    assert request_allowed("/pause_generation", bearer, api_key=None, admin_key="k-admin")
    assert request_allowed("/pause_generation", "bearer k-admin", api_key=None, admin_key="k-admin")
    assert not request_allowed(
        "/pause_generation", "Basic k-admin", api_key=None, admin_key="k-admin"
    )
    assert not request_allowed("/pause_generation", "Bearer", api_key=None, admin_key="k-admin")
    assert not request_allowed(
        "/pause_generation", "Bearer  k-admin", api_key=None, admin_key="k-admin"
    )
    # No keys: everything open.
    assert request_allowed("/release_memory_occupation", None, api_key=None, admin_key=None)


# --------------------------------------------------------------------------------- deaths


def history_lines(server: StandInServer) -> list[dict[str, Any]]:
    """The server's history file: one JSON line per op, written as each op completed."""
    assert server.history_file is not None
    text = Path(server.history_file).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()]


async def assert_dropped(request: Awaitable[httpx.Response]) -> None:
    """The call gets no HTTP answer at all: the connection drops, as a crashed SGLang's does."""
    with pytest.raises(httpx.TransportError) as err:
        answer = await request
        pytest.fail(f"got HTTP {answer.status_code} instead of a dropped connection")
    assert not isinstance(err.value, httpx.ConnectError), "the request never connected"


async def assert_gone(server: StandInServer) -> None:
    assert server.wait_dead(5.0), "the server process did not exit"
    assert server.returncode == DEATH_EXIT_CODE
    async with httpx.AsyncClient(timeout=TIMEOUT) as fresh:
        with pytest.raises(httpx.ConnectError):
            await fresh.get(f"{server.url}/server_info")
    assert "died" in server.stderr_text()


def assert_fatal_last(lines: list[dict[str, Any]], op: str) -> None:
    assert lines[-1]["op"] == "server_died" and lines[-1]["outcome"] == "fatal"
    assert lines[-2]["op"] == op and lines[-2]["outcome"] == "fatal"
    assert all(e["outcome"] != "fatal" for e in lines[:-2])


async def test_release_while_requests_run_under_in_place_pause_kills_the_server(
    standin_servers: dict[str, StandInServer],
) -> None:
    server = standin_servers["busy"]
    async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
        request = long_generate(client, server.url, "busy-1")
        await wait_running(client, server.url)
        assert (await client.post("/pause_generation", json={"mode": "in_place"})).is_success
        await assert_dropped(client.post("/release_memory_occupation", json={"tags": None}))
        await assert_dropped(request)  # in-flight generates drop with it
    await assert_gone(server)
    lines = history_lines(server)
    assert [e["op"] for e in lines[-3:-1]] == ["pause_generation", "release_memory_occupation"]
    assert_fatal_last(lines, "release_memory_occupation")
    assert "not idle" in lines[-2]["detail"]


async def test_releasing_a_released_tag_kills_the_server(
    standin_servers: dict[str, StandInServer],
) -> None:
    server = standin_servers["double"]
    async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
        assert (await client.post("/pause_generation", json={"mode": "retract"})).is_success
        assert (await client.post("/flush_cache")).status_code == 200
        first = await client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert first.status_code == 200
        await assert_dropped(client.post("/release_memory_occupation", json={"tags": ["kv_cache"]}))
    await assert_gone(server)
    lines = history_lines(server)
    ops = [e["op"] for e in lines]
    assert ops == [
        "pause_generation",
        "flush_cache",
        "release_memory_occupation",
        "release_memory_occupation",
        "server_died",
    ]
    assert_fatal_last(lines, "release_memory_occupation")


async def test_resuming_a_tag_that_is_not_released_kills_the_server(
    standin_servers: dict[str, StandInServer],
) -> None:
    server = standin_servers["resume"]
    async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
        await assert_dropped(client.post("/resume_memory_occupation", json={"tags": ["weights"]}))
    await assert_gone(server)
    assert_fatal_last(history_lines(server), "resume_memory_occupation")


async def test_release_kv_then_resume_without_tags_kills_the_server(
    standin_servers: dict[str, StandInServer],
) -> None:
    server = standin_servers["resume_all"]
    async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
        assert (await client.post("/pause_generation", json={"mode": "retract"})).is_success
        assert (await client.post("/flush_cache")).status_code == 200
        released = await client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert released.status_code == 200
        # No tags means all three, and weights / cuda_graph were never released.
        await assert_dropped(client.post("/resume_memory_occupation", json={}))
    await assert_gone(server)
    lines = history_lines(server)
    assert_fatal_last(lines, "resume_memory_occupation")
    assert "not released" in lines[-2]["detail"]


async def test_continue_after_release_with_a_request_waiting_kills_the_server(
    standin_servers: dict[str, StandInServer],
) -> None:
    server = standin_servers["continue"]
    async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
        assert (await client.post("/pause_generation", json={"mode": "retract"})).is_success
        assert (await client.post("/flush_cache")).status_code == 200
        assert (await client.post("/release_memory_occupation", json={})).status_code == 200
        waiting = long_generate(client, server.url, "waiter", tokens=5)

        async def queued() -> bool:
            return bool((await client.get("/_standin/stats")).json()["held"] == 1)

        await until(queued, what="the request to wait at the front end")
        # The continue itself may still be answered; the forward pass on released memory that
        # it lets run kills the server, and the waiting request's connection drops.
        with contextlib.suppress(httpx.TransportError):
            await client.post("/continue_generation", json={})
        await assert_dropped(waiting)
    await assert_gone(server)
    lines = history_lines(server)
    assert lines[-1]["op"] == "server_died"
    assert "illegal memory access" in lines[-1]["detail"]
    assert [e["op"] for e in lines[-4:-1]] == [
        "flush_cache",
        "release_memory_occupation",
        "continue_generation",
    ]


# --------------------------------------------------------------------------------- the command


def test_stand_in_waits_two_minutes_for_readiness_by_default() -> None:
    # A loaded 2-core CI machine has taken more than 30 s to start one.
    assert DEFAULT_STARTUP_TIMEOUT >= 120
    assert inspect.signature(StandInServer).parameters["startup_timeout"].default == (
        DEFAULT_STARTUP_TIMEOUT
    )


@pytest.mark.parametrize(("flag", "value"), [("--admin-key-env", None), ("--api-key-env", "")])
def test_fake_sglang_with_an_unset_key_variable_exits_2_naming_it(
    flag: str, value: str | None
) -> None:
    var = "ROLLOUT_LIFECYCLE_TEST_UNSET_KEY"
    env = {k: v for k, v in os.environ.items() if k != var}
    if value is not None:
        env[var] = value
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "rollout_lifecycle.cli", "fake-sglang", "--port", "0", flag, var],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert var in done.stderr and "READY" not in done.stdout
