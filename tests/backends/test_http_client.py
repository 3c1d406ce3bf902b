"""The SGLang HTTP client against httpx.MockTransport, the launcher against local processes.

No network: the client tests open no socket; the launcher tests use loopback only.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog

from rollout_lifecycle import (
    EngineBackend,
    EngineDead,
    EngineError,
    EngineHost,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
    IllegalEngineOp,
    InvalidArgument,
    PauseMode,
    SimulatedEngine,
    Tag,
    free_port,
)
from rollout_lifecycle.backends.http.wire import HTTPTimeouts, parse_version
from rollout_lifecycle.backends.secret import Secret
from rollout_lifecycle.backends.sglang.api import BY_PATH, SESSION_ALREADY_OPEN
from rollout_lifecycle.backends.sglang.client import SGLangHTTPEngine, sglang_http_factory
from rollout_lifecycle.backends.sglang.launch import (
    ADMIN_KEY_ENV,
    LaunchedSGLangEngine,
    launched_sglang_factory,
)
from rollout_lifecycle.contract.outcome import SESSION_OPEN

URL = "http://engine.test:30000"
ADMIN_KEY = "sk-admin-7f3a9c1e55d0"
API_KEY = "sk-api-0b12e4d6c8aa"
KEYS = (ADMIN_KEY, API_KEY)

Handler = Callable[[httpx.Request], httpx.Response]


def default_answer(request: httpx.Request) -> httpx.Response:
    """What SGLang 0.5.23 answers on success, per endpoint."""
    path = request.url.path
    if path in ("/pause_generation", "/continue_generation"):
        return httpx.Response(200, json={"message": "done", "status": "ok"})
    if path == "/flush_cache":
        return httpx.Response(200, text="Cache flushed.\n")
    if path in ("/release_memory_occupation", "/resume_memory_occupation"):
        return httpx.Response(200, content=b"null", headers={"content-type": "application/json"})
    if path in (
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/update_weight_version",
    ):
        return httpx.Response(200, json={"success": True, "message": "ok"})
    if path == "/model_info":
        return httpx.Response(200, json={"model_path": "m", "weight_version": "v3"})
    if path == "/server_info":
        return httpx.Response(200, json={"version": "0.5.23", "internal_states": [{}]})
    if path == "/generate":
        return httpx.Response(
            200,
            json={
                "text": "hi",
                "output_ids": [1],
                "meta_info": {"finish_reason": {"type": "stop"}},
            },
        )
    if path == "/abort_request":
        return httpx.Response(200)
    if path == "/weights_checker":
        # sglang 0.5.23 on a CPU, one rank (two of the tiny GPT-2's 28 tensors)
        sums = {"transformer.wte.weight": "3d00e7d758de4603", "transformer.ln_f.bias": "38723a"}
        rank = {"checksums": sums, "per_gpu_checksum": "ab", "parallelism_info": [{}]}
        body = {
            "success": True,
            "message": "Success.",
            "ranks": [rank],
            "per_engine_checksum": "cd",
        }
        return httpx.Response(200, json=body)
    if path in ("/init_weights_update_group", "/destroy_weights_update_group"):
        return httpx.Response(200, json={"success": True, "message": "ok"})
    if path == "/ready":
        return httpx.Response(200)
    return httpx.Response(404, json={"detail": "Not Found"})


class FakeServer:
    """Records every request the transport saw; answers with ``handler`` (default: success)."""

    def __init__(self, handler: Handler = default_answer) -> None:
        self.handler = handler
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.handler(request)

    @property
    def paths(self) -> list[str]:
        return [r.url.path for r in self.requests]


def make_engine(server: FakeServer, **kwargs: Any) -> SGLangHTTPEngine:
    kwargs.setdefault("retry_backoff", 0.0)
    # The attach check (one GET /server_info before the first lifecycle call) has tests of its
    # own; elsewhere each request counted is the call under test.
    kwargs.setdefault("check_version", False)
    return SGLangHTTPEngine(URL, transport=httpx.MockTransport(server), **kwargs)


def failing(times: int, failure: Callable[[httpx.Request], httpx.Response]) -> Handler:
    """Fail the first ``times`` requests with ``failure``, then answer as SGLang does."""
    count = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal count
        count += 1
        return failure(request) if count <= times else default_answer(request)

    return handler


def raising(exc_type: type[Exception], message: str = "boom") -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc_type(message, request=request)  # type: ignore[call-arg]

    return handler


def status(code: int, text: str = "nope") -> Handler:
    return lambda request: httpx.Response(code, text=text)


def assert_no_key(*texts: object) -> None:
    for text in texts:
        for key in KEYS:
            assert key not in str(text), f"a key leaked into {text!r}"


def assert_clean_exception(exc: BaseException) -> None:
    """No key in the exception's text, and no reference to httpx's request (headers)."""
    assert_no_key(str(exc), repr(exc), *exc.args)
    assert exc.__cause__ is None
    assert exc.__context__ is None


# --------------------------------------------------------------------------------- wire format

Call = Callable[[SGLangHTTPEngine], Awaitable[Any]]

WIRE_CASES: list[tuple[str, Call, str, str, dict[str, str], Any]] = [
    (
        "pause",
        lambda e: e.pause_generation(PauseMode.RETRACT),
        "POST",
        "/pause_generation",
        {},
        {"mode": "retract"},
    ),
    (
        "pause_abort",
        lambda e: e.pause_generation(PauseMode.ABORT),
        "POST",
        "/pause_generation",
        {},
        {"mode": "abort"},
    ),
    (
        "continue",
        lambda e: e.continue_generation(),
        "POST",
        "/continue_generation",
        {},
        {"torch_empty_cache": True},
    ),
    (
        "flush",
        lambda e: e.flush_cache(2.5),
        "POST",
        "/flush_cache",
        {"timeout": "2.5"},
        None,
    ),
    # The idle barrier's flush: no server-side timeout at all (flush_wrapper.py handle).
    ("flush_now", lambda e: e.flush_cache(0.0), "POST", "/flush_cache", {}, None),
    (
        "release",
        lambda e: e.release_memory_occupation([Tag.KV_CACHE, Tag.WEIGHTS, Tag.CUDA_GRAPH]),
        "POST",
        "/release_memory_occupation",
        {},
        {"tags": ["kv_cache", "weights", "cuda_graph"]},
    ),
    (
        "resume",
        lambda e: e.resume_memory_occupation([Tag.WEIGHTS]),
        "POST",
        "/resume_memory_occupation",
        {},
        {"tags": ["weights"]},
    ),
    (
        "begin",
        lambda e: e.begin_weight_update(),
        "POST",
        "/begin_weight_update",
        {},
        {"selector": "all"},
    ),
    ("end", lambda e: e.end_weight_update(), "POST", "/end_weight_update", {}, {}),
    (
        "disk",
        lambda e: e.update_weights_from_disk(
            "/ckpt/step7", weight_version="v7", flush_cache=False, abort_all_requests=False
        ),
        "POST",
        "/update_weights_from_disk",
        {},
        {
            "model_path": "/ckpt/step7",
            "load_format": None,
            "weight_version": "v7",
            "flush_cache": False,
            "abort_all_requests": False,
        },
    ),
    (
        "tensor",
        lambda e: e.update_weights_from_tensor(
            ["rank0-b64", "rank1-b64"],
            weight_version="v8",
            flush_cache=False,
            abort_all_requests=False,
            load_format="flattened_bucket",
        ),
        "POST",
        "/update_weights_from_tensor",
        {},
        {
            "serialized_named_tensors": ["rank0-b64", "rank1-b64"],
            "load_format": "flattened_bucket",
            "weight_version": "v8",
            "flush_cache": False,
            "abort_all_requests": False,
            "selector": "all",
        },
    ),
    (
        "distributed",
        lambda e: e.update_weights_from_distributed(
            ["w.a", "w.b"],
            ["bfloat16", "float32"],
            [[2, 3], [4]],
            "weights-group",
            weight_version=None,
            flush_cache=True,
            abort_all_requests=False,
            load_format="direct",
        ),
        "POST",
        "/update_weights_from_distributed",
        {},
        {
            "names": ["w.a", "w.b"],
            "dtypes": ["bfloat16", "float32"],
            "shapes": [[2, 3], [4]],
            "group_name": "weights-group",
            "load_format": "direct",
            "weight_version": None,
            "flush_cache": True,
            "abort_all_requests": False,
            "selector": "all",
        },
    ),
    (
        "init_group",
        lambda e: e.init_weights_update_group(
            "10.0.0.5", 29500, 1, 3, group_name="weights-group", backend="gloo"
        ),
        "POST",
        "/init_weights_update_group",
        {},
        # sglang: io_struct.py InitWeightsUpdateGroupReqInput
        {
            "master_address": "10.0.0.5",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 3,
            "group_name": "weights-group",
            "backend": "gloo",
        },
    ),
    (
        "destroy_group",
        lambda e: e.destroy_weights_update_group("weights-group"),
        "POST",
        "/destroy_weights_update_group",
        {},
        {"group_name": "weights-group"},
    ),
    (
        "weight_version_update",
        lambda e: e.update_weight_version("v9", abort_all_requests=False),
        "POST",
        "/update_weight_version",
        {},
        {"new_version": "v9", "abort_all_requests": False},
    ),
    ("weight_version", lambda e: e.weight_version(), "GET", "/model_info", {}, None),
    ("server_info", lambda e: e.server_info(), "GET", "/server_info", {}, None),
    (
        "weight_fingerprint",
        lambda e: e.weight_fingerprint(),
        "POST",
        "/weights_checker",
        {},
        {"action": "checksum", "selector": "target"},
    ),
    (
        "generate",
        lambda e: e.generate({"text": "2+2=", "sampling_params": {"max_new_tokens": 4}}),
        "POST",
        "/generate",
        {},
        {"text": "2+2=", "sampling_params": {"max_new_tokens": 4}},
    ),
    (
        "abort",
        lambda e: e.abort_request("req-1"),
        "POST",
        "/abort_request",
        {},
        {"rid": "req-1", "abort_all": False},
    ),
]


@pytest.mark.parametrize(
    ("call", "method", "path", "query", "body"),
    [case[1:] for case in WIRE_CASES],
    ids=[case[0] for case in WIRE_CASES],
)
async def test_each_call_sends_the_exact_method_path_query_and_body(
    call: Call, method: str, path: str, query: dict[str, str], body: Any
) -> None:
    server = FakeServer()
    engine = make_engine(server)
    await call(engine)
    await engine.close()
    assert len(server.requests) == 1
    request = server.requests[0]
    assert request.method == method
    assert request.url.path == path
    assert dict(request.url.params) == query
    if body is None:
        assert request.content == b""
    else:
        assert request.headers["content-type"] == "application/json"
        assert json.loads(request.content) == body


async def test_every_post_but_flush_carries_a_json_body() -> None:
    # SGLang answers a POST without a body with 400 ("Field required").
    server = FakeServer()
    engine = make_engine(server)
    for _, call, *_ in WIRE_CASES:
        await call(engine)
    posts = [r for r in server.requests if r.method == "POST" and r.url.path != "/flush_cache"]
    assert posts
    for request in posts:
        assert request.content, request.url.path
        json.loads(request.content)


async def test_answers_come_back_as_values() -> None:
    engine = make_engine(FakeServer())
    assert await engine.weight_version() == "v3"
    found = await engine.weight_fingerprint()
    assert found["scheme"] == "sglang-sha256-64"
    assert found["tensors"]["transformer.wte.weight"] == "3d00e7d758de4603"
    assert (await engine.server_info())["version"] == "0.5.23"
    assert (await engine.generate({"text": "x"}))["text"] == "hi"
    await engine.release_memory_occupation([Tag.KV_CACHE])  # 200 null is success


async def test_flush_waits_for_the_server_side_timeout_plus_a_margin() -> None:
    server = FakeServer()
    engine = make_engine(server, timeouts=HTTPTimeouts(flush_margin=7.0, connect=1.5))
    await engine.flush_cache(30.0)
    timeouts = server.requests[0].extensions["timeout"]
    assert timeouts["read"] == pytest.approx(37.0, abs=0.05)
    assert timeouts["connect"] == 1.5
    assert server.requests[0].url.params["timeout"] == "30.0"


async def test_each_kind_of_call_has_its_own_timeout() -> None:
    server = FakeServer()
    timeouts = HTTPTimeouts(control=11, memory=22, weights=33, probe=4, generate=55)
    engine = make_engine(server, timeouts=timeouts)
    await engine.pause_generation(PauseMode.RETRACT)
    await engine.release_memory_occupation([Tag.KV_CACHE])
    await engine.update_weights_from_disk(
        "/p", weight_version=None, flush_cache=False, abort_all_requests=False
    )
    await engine.server_info()
    await engine.generate({"text": "x"})
    reads = [r.extensions["timeout"]["read"] for r in server.requests]
    assert reads == [11, 22, 33, 4, 55]


async def test_flush_rejects_a_bad_timeout_before_sending() -> None:
    server = FakeServer()
    engine = make_engine(server)
    for bad in (-1.0, float("nan"), float("inf"), True):
        with pytest.raises(InvalidArgument):
            await engine.flush_cache(bad)
    assert server.requests == []


# --------------------------------------------------------------------------------- auth


@pytest.mark.parametrize(
    ("admin", "api", "control_key", "normal_key"),
    [
        (ADMIN_KEY, API_KEY, ADMIN_KEY, API_KEY),
        (ADMIN_KEY, None, ADMIN_KEY, ADMIN_KEY),
        (None, API_KEY, API_KEY, API_KEY),
        (None, None, None, None),
    ],
    ids=["both", "admin_only", "api_only", "none"],
)
async def test_control_calls_use_the_admin_key_and_normal_calls_the_api_key(
    admin: str | None, api: str | None, control_key: str | None, normal_key: str | None
) -> None:
    server = FakeServer()
    engine = make_engine(server, admin_key=admin, api_key=Secret(api) if api else None)
    for _, call, *_ in WIRE_CASES:
        await call(engine)
    normal = {"/generate", "/server_info", "/model_info"}
    for request in server.requests:
        expected = normal_key if request.url.path in normal else control_key
        header = request.headers.get("authorization")
        assert header == (f"Bearer {expected}" if expected else None), request.url.path


async def test_a_refused_key_is_a_401_rejection_that_does_not_show_the_key() -> None:
    server = FakeServer(status(401, '{"error": "Unauthorized"}'))
    engine = make_engine(server, admin_key=ADMIN_KEY, api_key=API_KEY)
    with pytest.raises(EngineRejected) as info:
        await engine.pause_generation(PauseMode.RETRACT)
    assert info.value.status == 401
    assert "refused the admin key" in info.value.message
    assert_clean_exception(info.value)
    assert len(server.requests) == 1  # a wrong key does not get better by repeating it
    with pytest.raises(EngineRejected, match="refused the api key"):
        await engine.generate({"text": "x"})


async def test_a_401_without_a_key_says_none_was_given() -> None:
    engine = make_engine(FakeServer(status(401)))
    with pytest.raises(EngineRejected, match="none was given") as info:
        await engine.server_info()
    assert info.value.status == 401


# --------------------------------------------------------------------------------- answers


async def test_flush_400_is_a_rejection_and_is_not_retried_by_the_client() -> None:
    server = FakeServer(status(400, "Cache not flushed: the engine is not idle."))
    engine = make_engine(server)
    with pytest.raises(EngineRejected, match="not idle") as info:
        await engine.flush_cache(0.0)
    assert info.value.status == 400
    assert len(server.requests) == 1


async def test_engine_host_retries_a_not_idle_flush_until_the_engine_is_idle() -> None:
    server = FakeServer(failing(2, status(400, "not idle")))
    host = EngineHost(make_engine(server))
    await host.flush_cache(deadline=5.0, retry_interval=0.0)
    assert server.paths == ["/flush_cache"] * 3
    # The idle barrier never asks for a server-side wait: with ?timeout=T SGLang counts the
    # waiting queue, where a retract pause keeps requests, and fails after T every time.
    assert [dict(r.url.params) for r in server.requests] == [{}, {}, {}]


@pytest.mark.parametrize("code", [200, 400])
async def test_success_false_is_a_rejection(code: int) -> None:
    answer = {"success": False, "message": "no weight update session is open"}
    server = FakeServer(lambda request: httpx.Response(code, json=answer))
    engine = make_engine(server)
    with pytest.raises(EngineRejected, match="no weight update session") as info:
        await engine.end_weight_update()
    assert info.value.status == code
    with pytest.raises(EngineRejected, match="no weight update session"):
        await engine.update_weights_from_disk(
            "/p", weight_version="v1", flush_cache=False, abort_all_requests=False
        )
    with pytest.raises(EngineRejected):
        await engine.update_weights_from_tensor(
            ["x"], weight_version=None, flush_cache=False, abort_all_requests=False
        )


async def test_sglang_json_error_answers_are_quoted_by_their_message() -> None:
    answer = {"object": "error", "message": "bad mode 'sideways'", "code": 400}
    engine = make_engine(FakeServer(lambda request: httpx.Response(400, json=answer)))
    with pytest.raises(EngineRejected, match="bad mode 'sideways'") as info:
        await engine.continue_generation()
    assert info.value.status == 400


async def test_a_long_error_body_is_truncated() -> None:
    engine = make_engine(FakeServer(status(500, "x" * 5000)), retries=0)
    with pytest.raises(EngineRejected) as info:
        await engine.generate({"text": "x"})
    assert info.value.status == 500
    assert 500 <= len(info.value.message) < 700


@pytest.mark.parametrize(
    ("call", "answer"),
    [
        (lambda e: e.weight_version(), httpx.Response(200, text="<html>oops")),
        (lambda e: e.weight_version(), httpx.Response(200, json=["not", "an", "object"])),
        (lambda e: e.weight_version(), httpx.Response(200, json={"weight_version": 5})),
        (lambda e: e.server_info(), httpx.Response(200, text="")),
        (lambda e: e.generate({"text": "x"}), httpx.Response(200, json=[{"text": "a"}])),
        (lambda e: e.begin_weight_update(), httpx.Response(200, json={"message": "what"})),
        (lambda e: e.begin_weight_update(), httpx.Response(200, text="{truncated")),
        (lambda e: e.weight_fingerprint(), httpx.Response(200, json={"success": True})),
        (
            lambda e: e.weight_fingerprint(),
            httpx.Response(200, json={"success": True, "ranks": [{"checksums": None}]}),
        ),
    ],
    ids=[
        "model_info_html",
        "model_info_list",
        "version_not_str",
        "server_info_empty",
        "generate_list",
        "no_success_field",
        "malformed_json",
        "checksums_without_ranks",
        "rank_without_checksums",
    ],
)
async def test_a_garbage_answer_is_a_clear_engine_error(call: Call, answer: httpx.Response) -> None:
    engine = make_engine(FakeServer(lambda request: answer))
    with pytest.raises(EngineError, match="garbage answer") as info:
        await call(engine)
    assert type(info.value) is EngineError


async def test_server_info_falls_back_to_the_old_path_on_404() -> None:
    def old_server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_server_info":
            return httpx.Response(200, json={"version": "0.4"})
        return httpx.Response(404, json={"detail": "Not Found"})

    server = FakeServer(old_server)
    assert (await make_engine(server).server_info()) == {"version": "0.4"}
    assert server.paths == ["/server_info", "/get_server_info"]


async def test_server_info_never_probes_health() -> None:
    # /health runs a generation: on a paused server it hangs and marks the server unhealthy.
    server = FakeServer()
    engine = make_engine(server)
    await engine.pause_generation(PauseMode.RETRACT)
    await engine.server_info()
    await engine.weight_version()
    assert not [p for p in server.paths if p.startswith("/health")]


# --------------------------------------------------------------------------------- translation


@pytest.mark.parametrize(
    ("exc_type", "expected"),
    [
        (httpx.ConnectError, EngineDead),
        (httpx.ReadError, EngineUnreachable),
        (httpx.WriteError, EngineUnreachable),
        (httpx.RemoteProtocolError, EngineUnreachable),
        (httpx.ReadTimeout, EngineTimeout),
        (httpx.ConnectTimeout, EngineTimeout),
    ],
)
async def test_transport_errors_become_engine_errors(
    exc_type: type[Exception], expected: type[EngineError]
) -> None:
    engine = make_engine(FakeServer(raising(exc_type)), retries=0)
    with pytest.raises(expected) as info:
        await engine.release_memory_occupation([Tag.KV_CACHE])
    assert type(info.value) is expected
    assert info.value.op == "release_memory_occupation"
    assert exc_type.__name__ in info.value.message
    assert_clean_exception(info.value)


async def test_a_dropped_connection_during_release_is_unreachable_not_retried() -> None:
    # How SGLang's death looks to the release that killed it; a second release would be fatal.
    server = FakeServer(raising(httpx.RemoteProtocolError, "Server disconnected"))
    engine = make_engine(server)
    with pytest.raises(EngineUnreachable, match="dropped"):
        await engine.release_memory_occupation([Tag.KV_CACHE, Tag.WEIGHTS])
    assert len(server.requests) == 1


@pytest.mark.parametrize("code", [500, 502, 503, 504])
@pytest.mark.parametrize(
    "call",
    [
        lambda e: e.release_memory_occupation([Tag.KV_CACHE]),
        lambda e: e.resume_memory_occupation([Tag.KV_CACHE]),
    ],
    ids=["release", "resume"],
)
async def test_a_memory_call_answered_5xx_has_an_unknown_effect_and_is_not_retried(
    code: int, call: Call
) -> None:
    # A process shutting down, or a handler that raised after it acted: the tags may or may
    # not have moved, so the ledger must not read "nothing happened" (a second release kills).
    server = FakeServer(status(code, "Internal Server Error"))
    with pytest.raises(EngineUnreachable, match=f"answered {code}.*effect unknown"):
        await call(make_engine(server, retries=3))
    assert len(server.requests) == 1


async def test_a_weight_call_answered_500_is_a_refusal() -> None:
    # How SGLang refuses a tensor push on a data-parallel server (an assert before dispatch).
    server = FakeServer(status(500, "data-parallel replicas are not supported"))
    with pytest.raises(EngineRejected) as info:
        await make_engine(server).update_weights_from_tensor(
            ["t"], weight_version="v", flush_cache=False, abort_all_requests=False
        )
    assert info.value.status == 500


# --------------------------------------------------------------------------------- retries

REPEATABLE: list[tuple[str, Call]] = [
    ("pause", lambda e: e.pause_generation(PauseMode.RETRACT)),
    ("continue", lambda e: e.continue_generation()),
    ("flush", lambda e: e.flush_cache(1.0)),
    ("server_info", lambda e: e.server_info()),
    ("weight_version", lambda e: e.weight_version()),
]

NEVER_REPEATED: list[tuple[str, Call]] = [
    ("release", lambda e: e.release_memory_occupation([Tag.KV_CACHE])),
    ("resume", lambda e: e.resume_memory_occupation([Tag.KV_CACHE])),
    ("begin", lambda e: e.begin_weight_update()),
    ("end", lambda e: e.end_weight_update()),
    (
        "disk",
        lambda e: e.update_weights_from_disk(
            "/p", weight_version="v", flush_cache=False, abort_all_requests=False
        ),
    ),
    (
        "tensor",
        lambda e: e.update_weights_from_tensor(
            ["t"], weight_version="v", flush_cache=False, abort_all_requests=False
        ),
    ),
    ("version", lambda e: e.update_weight_version("v", abort_all_requests=False)),
    ("generate", lambda e: e.generate({"text": "x"})),
]

UNAVAILABLE = status(503, "Service Unavailable")
REFUSED = raising(httpx.ConnectError, "[Errno 111] Connection refused")


@pytest.mark.parametrize(("name", "call"), REPEATABLE, ids=[c[0] for c in REPEATABLE])
@pytest.mark.parametrize("failure", [UNAVAILABLE, REFUSED], ids=["503", "refused"])
async def test_repeatable_calls_are_retried_until_they_succeed(
    name: str, call: Call, failure: Handler
) -> None:
    server = FakeServer(failing(2, failure))
    await call(make_engine(server, retries=3))
    assert len(server.requests) == 3


@pytest.mark.parametrize(("name", "call"), REPEATABLE, ids=[c[0] for c in REPEATABLE])
async def test_retries_are_bounded(name: str, call: Call) -> None:
    server = FakeServer(REFUSED)
    with pytest.raises(EngineDead, match="connection refused"):
        await call(make_engine(server, retries=2))
    assert len(server.requests) == 3
    server = FakeServer(UNAVAILABLE)
    with pytest.raises(EngineRejected) as info:
        await call(make_engine(server, retries=2))
    assert info.value.status == 503
    assert len(server.requests) == 3


@pytest.mark.parametrize(("name", "call"), NEVER_REPEATED, ids=[c[0] for c in NEVER_REPEATED])
@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        # A 503 on a call that must not repeat: the effect is unknown (a gateway may have
        # forwarded it), so it is not a refusal.
        (UNAVAILABLE, EngineUnreachable),
        (REFUSED, EngineDead),
        (raising(httpx.ReadError), EngineUnreachable),
        (raising(httpx.ReadTimeout), EngineTimeout),
    ],
    ids=["503", "refused", "dropped", "timeout"],
)
async def test_release_resume_weights_and_generate_are_never_retried(
    name: str, call: Call, failure: Handler, expected: type[EngineError]
) -> None:
    server = FakeServer(failing(1, failure))
    with pytest.raises(expected):
        await call(make_engine(server, retries=5))
    assert len(server.requests) == 1


@pytest.mark.parametrize(("name", "call"), NEVER_REPEATED, ids=[c[0] for c in NEVER_REPEATED])
async def test_a_call_sent_once_is_tried_again_when_no_connection_was_made(
    name: str, call: Call
) -> None:
    # A connect that timed out sent nothing: the second attempt is the call's only delivery.
    server = FakeServer(failing(1, raising(httpx.ConnectTimeout)))
    await call(make_engine(server, retries=3, retry_backoff=0.01))
    assert len(server.requests) == 2
    # Bounded like any retry: the last attempt's timeout is what the caller sees.
    server = FakeServer(raising(httpx.ConnectTimeout))
    with pytest.raises(EngineTimeout, match=r"attempt 3\): could not connect in time"):
        await call(make_engine(server, retries=2, retry_backoff=0.01))
    assert len(server.requests) == 3


async def test_a_timed_out_pause_is_not_repeated() -> None:
    # The server got it and is slow; repeating would only double the wait.
    server = FakeServer(raising(httpx.ReadTimeout))
    with pytest.raises(EngineTimeout):
        await make_engine(server).pause_generation(PauseMode.ABORT)
    assert len(server.requests) == 1


async def test_a_retried_flush_asks_only_for_the_time_that_is_left() -> None:
    server = FakeServer(failing(2, UNAVAILABLE))
    engine = make_engine(server, retry_backoff=0.05)
    await engine.flush_cache(10.0)
    waits = [float(r.url.params["timeout"]) for r in server.requests]
    assert waits[0] == 10.0
    assert waits[0] > waits[1] > waits[2]
    assert waits[2] <= 10.0 - 0.1


# --------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "tags",
    [[], (), "kv_cache", ["kv_cache", "kv_cache"], ["kv-cache"]],
    ids=["empty_list", "empty_tuple", "bare_string", "duplicate", "typo"],
)
async def test_bad_tags_are_refused_before_anything_is_sent(tags: Any) -> None:
    # An empty list means all three tags to SGLang: the classic resume-everything trap.
    server = FakeServer()
    engine = make_engine(server)
    with pytest.raises(InvalidArgument):
        await engine.resume_memory_occupation(tags)
    with pytest.raises(InvalidArgument):
        await engine.release_memory_occupation(tags)
    assert server.requests == []


async def test_flags_must_be_booleans() -> None:
    server = FakeServer()
    engine = make_engine(server)
    with pytest.raises(InvalidArgument, match="abort_all_requests"):
        await engine.update_weight_version("v", abort_all_requests=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="flush_cache"):
        await engine.update_weights_from_disk(
            "/p",
            weight_version=None,
            flush_cache="no",  # type: ignore[arg-type]
            abort_all_requests=False,
        )
    with pytest.raises(InvalidArgument, match="stream"):
        await engine.generate({"text": "x", "stream": True})
    with pytest.raises(InvalidArgument, match="one entry per tensor"):
        await engine.update_weights_from_distributed(
            ["a"], [], [], "g", weight_version=None, flush_cache=False, abort_all_requests=False
        )
    assert server.requests == []


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("ftp://engine:30000", "ftp://engine:30000"),
        ("engine:30000", "engine:30000"),
        ("http://", "http://"),
        ("http://engine:99999", "http://engine:99999"),
        ("http://engine:30000/?x=1", "http://engine:30000/?x=1"),
    ],
)
def test_a_bad_url_is_refused_and_named(url: str, shown: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        SGLangHTTPEngine(url)
    assert shown in str(info.value)


def test_a_url_with_credentials_is_refused_without_showing_them() -> None:
    with pytest.raises(InvalidArgument, match="user info") as info:
        SGLangHTTPEngine(f"http://admin:{ADMIN_KEY}@engine:30000")
    assert "engine:30000" in str(info.value)
    assert_no_key(str(info.value))


@pytest.mark.parametrize("field", ["connect", "control", "memory", "weights", "probe", "generate"])
@pytest.mark.parametrize("value", [0, -1.0, float("inf"), float("nan"), "5", True])
def test_timeouts_must_be_positive_finite_numbers(field: str, value: Any) -> None:
    with pytest.raises(InvalidArgument) as info:
        HTTPTimeouts(**{field: value})
    assert repr(field) in str(info.value)
    assert repr(value) in str(info.value)


def test_engine_arguments_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="retries"):
        SGLangHTTPEngine(URL, retries=-1)
    with pytest.raises(InvalidArgument, match="retry_backoff"):
        SGLangHTTPEngine(URL, retry_backoff=float("nan"))
    with pytest.raises(InvalidArgument, match="admin_key"):
        SGLangHTTPEngine(URL, admin_key=123)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="label"):
        SGLangHTTPEngine(URL, label=f"engine-{ADMIN_KEY}", admin_key=ADMIN_KEY)


# --------------------------------------------------------------------------------- secrecy


async def test_keys_never_appear_in_repr_label_events_or_errors() -> None:
    def echo_headers(request: httpx.Request) -> httpx.Response:
        # A server (or proxy) that quotes the request back, credentials included.
        auth = request.headers.get("authorization", "")
        if request.url.path == "/server_info":
            args = {"admin_api_key": ADMIN_KEY, "api_key": API_KEY, "port": 30000}
            return httpx.Response(200, json={"server_args": args, "note": f"called with {auth}"})
        if request.url.path == "/flush_cache":
            raise httpx.ConnectError(f"refused while sending {auth}", request=request)
        return httpx.Response(400, json={"message": f"bad request with {auth}"})

    engine = make_engine(FakeServer(echo_headers), admin_key=ADMIN_KEY, api_key=API_KEY)
    assert_no_key(repr(engine), str(engine), engine.label)
    errors: list[BaseException] = []
    with structlog.testing.capture_logs() as events:
        info = await engine.server_info()
        for _, call, *_ in WIRE_CASES:
            try:
                await call(engine)
            except EngineError as exc:
                errors.append(exc)
    assert_no_key(json.dumps(info))
    assert info["server_args"]["port"] == 30000
    assert len(errors) == len(WIRE_CASES) - 1  # every call but server_info failed
    for error in errors:
        assert_clean_exception(error)
        assert_no_key(pickle.loads(pickle.dumps(error)))
    assert events
    for event in events:
        assert_no_key(repr(event))


async def test_each_http_call_is_a_debug_event_without_headers() -> None:
    engine = make_engine(FakeServer(failing(1, UNAVAILABLE)), admin_key=ADMIN_KEY, label="eng-0")
    with structlog.testing.capture_logs() as events:
        await engine.pause_generation(PauseMode.RETRACT)
    requests = [e for e in events if e["event"] == "http.request"]
    assert [(e["status"], e["attempt"]) for e in requests] == [(503, 1), (200, 2)]
    for event in requests:
        assert event["log_level"] == "debug"
        assert event["engine"] == "eng-0"
        assert event["method"] == "POST"
        assert event["path"] == "/pause_generation"
        assert event["duration_s"] >= 0
        assert not {"headers", "authorization"} & set(event)
        assert_no_key(repr(event))


def test_factories_pickle_and_never_show_the_keys() -> None:
    factory = sglang_http_factory(URL, admin_key=ADMIN_KEY, retries=1)
    assert_no_key(repr(factory))
    engine = pickle.loads(pickle.dumps(factory))()
    assert isinstance(engine, SGLangHTTPEngine)
    assert isinstance(engine, EngineBackend)
    assert engine.url == URL
    launched = launched_sglang_factory("/models/m", port=31000, api_key=API_KEY)
    assert_no_key(repr(launched), repr(pickle.loads(pickle.dumps(launched))()))
    with pytest.raises(InvalidArgument):
        sglang_http_factory("gopher://x")


# --------------------------------------------------------------------------------- the client


async def test_the_client_opens_lazily_and_close_is_final_and_idempotent() -> None:
    server = FakeServer()
    engine = make_engine(server)  # built outside any request: opens nothing
    await engine.close()
    await engine.close()
    with pytest.raises(EngineDead, match="closed"):
        await engine.server_info()
    assert server.requests == []


async def test_the_client_follows_the_running_loop() -> None:
    server = FakeServer()
    engine = make_engine(server)

    def in_new_loop() -> None:
        asyncio.run(engine.server_info())

    await asyncio.to_thread(in_new_loop)  # a client bound to that (now closed) loop
    await engine.server_info()  # is replaced, not reused, on this one
    await engine.close()
    assert len(server.requests) == 2


async def test_the_http_engine_serves_an_engine_host() -> None:
    server = FakeServer()
    host = EngineHost(make_engine(server))
    await host.pause_generation("retract")
    await host.flush_cache(5.0)
    await host.release_memory_occupation(["kv_cache", "weights", "cuda_graph"])
    await host.resume_memory_occupation(["weights"])
    await host.begin_weight_update()
    await host.update_weights_from_tensor(["b64"], weight_version="v1")
    await host.end_weight_update()
    await host.update_weight_version("v1")
    await host.resume_memory_occupation(["kv_cache", "cuda_graph"])
    await host.continue_generation()
    assert server.paths == [
        "/pause_generation",
        "/flush_cache",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/end_weight_update",
        "/update_weight_version",
        "/resume_memory_occupation",
        "/continue_generation",
    ]
    bodies = {r.url.path: r.content for r in server.requests}
    assert json.loads(bodies["/update_weights_from_tensor"])["abort_all_requests"] is False
    assert json.loads(bodies["/update_weight_version"])["abort_all_requests"] is False


# --------------------------------------------------------------------------------- launcher

# A stand-in for a server: stdlib only, loopback only. Modes: ok (serves /ready, /model_info and
# /server_info after a short start-up), exit (fails at once), hang (never listens), stubborn
# (serves, and ignores SIGTERM), warming (serves /model_info, but /ready stays 503, as SGLang
# before warm-up), old (reports SGLang 0.5.20).
SERVER_SCRIPT = textwrap.dedent(
    """
    import http.server, json, os, signal, sys, time
    port, mode = int(sys.argv[1]), sys.argv[2]
    key = os.environ.get("ROLLOUT_LIFECYCLE_ADMIN_API_KEY")
    accepted = {f"Bearer {k}" for k in (key, os.environ.get("ROLLOUT_LIFECYCLE_API_KEY")) if k}
    cuda_graph = os.environ.get("SGLANG_MEMORY_SAVER_CUDA_GRAPH")
    print(f"starting: admin_api_key={key} cuda_graph={cuda_graph}", file=sys.stderr, flush=True)
    if mode == "exit":
        print("fatal: no GPU found", file=sys.stderr, flush=True)
        sys.exit(3)
    if mode == "hang":
        time.sleep(600)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(0.3)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/ready":  # open, as in SGLang
                code, body = (503 if mode == "warming" else 200), {}
            elif accepted and self.headers.get("Authorization") not in accepted:
                code, body = 401, {"error": "Unauthorized"}
            elif self.path in ("/model_info", "/server_info"):
                version = "0.5.20" if mode == "old" else "0.5.23"
                code, body = 200, {"weight_version": "v0", "path": self.path, "version": version}
            else:
                code, body = 404, {"detail": "Not Found"}
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args):
            print("served " + fmt % args, flush=True)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print("ready", flush=True)
    server.serve_forever()
    """
)


def launched(port: int, mode: str, **kwargs: Any) -> LaunchedSGLangEngine:
    kwargs.setdefault("startup_timeout", 20.0)
    return LaunchedSGLangEngine(
        "unused-model",
        port=port,
        command=[sys.executable, "-c", SERVER_SCRIPT, str(port), mode],
        timeouts=HTTPTimeouts(probe=2.0, connect=1.0),
        **kwargs,
    )


def command_line(pid: int) -> str:
    """What every user of the machine sees of a process's command line (Linux)."""
    path = Path(f"/proc/{pid}/cmdline")
    return path.read_bytes().decode(errors="replace") if path.exists() else ""


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_a_launched_server_starts_forwards_its_output_and_stops_on_close(
    engines: list[LaunchedSGLangEngine],
) -> None:
    port = free_port()
    engine = launched(port, "ok", admin_key=ADMIN_KEY)
    engines.append(engine)
    assert_no_key(repr(engine), engine.command, engine.label)
    with structlog.testing.capture_logs() as events:
        await engine.start()
        assert engine.pid is not None and engine.returncode is None
        assert await engine.weight_version() == "v0"
        assert (await engine.server_info())["path"] == "/server_info"
        # A second engine on the same port must not adopt the first one's server.
        other = launched(port, "ok")
        engines.append(other)
        with pytest.raises(EngineDead, match="already answers"):
            await other.start()
        assert other.pid is None
        pid = engine.pid
        await engine.close()
        await engine.close()
    assert engine.returncode is not None
    assert gone(pid)
    lines = [e["line"] for e in events if e["event"] == "sglang.log"]
    assert "starting: admin_api_key=******** cuda_graph=1" in lines  # the key reached the child
    assert "ready" in lines
    assert any(line.startswith("served ") for line in lines)  # stdout as well as stderr
    assert {e["event"] for e in events} >= {"sglang.start", "sglang.ready", "sglang.exit"}
    for event in events:
        assert_no_key(repr(event))
    with pytest.raises(EngineDead, match="closed"):
        await engine.server_info()


async def test_any_call_starts_the_server_lazily(engines: list[LaunchedSGLangEngine]) -> None:
    engine = launched(free_port(), "ok")
    engines.append(engine)
    assert engine.pid is None
    results = await asyncio.gather(engine.weight_version(), engine.server_info())
    assert results[0] == "v0"
    await engine.close()
    assert engine.returncode is not None


async def test_a_server_that_exits_at_once_is_dead_with_its_exit_code(
    engines: list[LaunchedSGLangEngine],
) -> None:
    engine = launched(free_port(), "exit", admin_key=ADMIN_KEY)
    engines.append(engine)
    started = time.monotonic()
    with pytest.raises(EngineDead) as info:
        await engine.start()
    assert time.monotonic() - started < 10
    assert "exited with code 3" in info.value.message
    assert "fatal: no GPU found" in info.value.message
    assert_no_key(str(info.value))
    with pytest.raises(EngineDead, match="start failed earlier"):
        await engine.pause_generation(PauseMode.RETRACT)
    await engine.close()


async def test_a_server_that_never_gets_ready_times_out_and_is_killed(
    engines: list[LaunchedSGLangEngine],
) -> None:
    engine = launched(free_port(), "hang", startup_timeout=1.0)
    engines.append(engine)
    started = time.monotonic()
    with pytest.raises(EngineTimeout, match="not ready within 1s"):
        await engine.start()
    assert time.monotonic() - started < 1.0 + 12.0  # start-up deadline + SIGTERM grace
    assert engine.returncode is not None
    assert gone(engine.pid or 0)


async def test_close_kills_a_server_that_ignores_sigterm(
    engines: list[LaunchedSGLangEngine],
) -> None:
    engine = launched(free_port(), "stubborn", stop_grace=0.5)
    engines.append(engine)
    await engine.start()
    started = time.monotonic()
    await engine.close()
    assert time.monotonic() - started < 6.0
    assert engine.returncode == -signal.SIGKILL


async def test_a_call_after_the_server_died_reports_its_exit_code(
    engines: list[LaunchedSGLangEngine],
) -> None:
    engine = launched(free_port(), "ok")
    engines.append(engine)
    await engine.start()
    assert engine.pid is not None
    os.kill(engine.pid, signal.SIGKILL)
    with pytest.raises(EngineDead, match="exited with code -9"):
        await engine.server_info()
    await engine.close()


def test_the_default_command_launches_sglang_with_the_memory_saver() -> None:
    engine = LaunchedSGLangEngine("/models/m", port=30001, extra_args=["--tp", "2"])
    assert engine.command == [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/m",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--enable-memory-saver",
        "--tp",
        "2",
    ]
    keyed = LaunchedSGLangEngine("/models/m", port=30001, admin_key=ADMIN_KEY)
    assert keyed.command[1] == "-c"
    assert keyed.command[3:] == engine.command[3:10]
    assert_no_key(keyed.command)
    with pytest.raises(InvalidArgument, match="--api-key"):
        LaunchedSGLangEngine("/m", port=30001, extra_args=["--api-key", API_KEY])
    with pytest.raises(InvalidArgument, match="--admin-api-key"):
        LaunchedSGLangEngine("/m", port=30001, extra_args=[f"--admin-api-key={ADMIN_KEY}"])
    with pytest.raises(InvalidArgument, match="port"):
        LaunchedSGLangEngine("/m", port=0)
    with pytest.raises(InvalidArgument, match="startup_timeout"):
        LaunchedSGLangEngine("/m", port=30001, startup_timeout=0)


FAKE_LAUNCH_SERVER = textwrap.dedent(
    """
    import argparse, os, runpy, sys
    parser = argparse.ArgumentParser()
    for flag in ("--model-path", "--host", "--port", "--admin-api-key", "--api-key"):
        parser.add_argument(flag)
    parser.add_argument("--enable-memory-saver", action="store_true")
    args = parser.parse_args(sys.argv[1:])
    print(f"memory_saver={args.enable_memory_saver} admin={args.admin_api_key} "
          f"api={args.api_key} env_has_key={'ROLLOUT_LIFECYCLE_ADMIN_API_KEY' in os.environ}",
          file=sys.stderr, flush=True)
    os.environ["ROLLOUT_LIFECYCLE_ADMIN_API_KEY"] = args.admin_api_key
    os.environ["ROLLOUT_LIFECYCLE_API_KEY"] = args.api_key
    sys.argv = ["server", args.port, "ok"]
    exec(compile(os.environ["STANDIN_SCRIPT"], "standin", "exec"))
    """
)


async def test_the_default_command_hands_keys_to_sglang_off_the_command_line(
    tmp_path: Path, engines: list[LaunchedSGLangEngine]
) -> None:
    # A fake ``sglang.launch_server`` shows what the real one would receive.
    package = tmp_path / "sglang"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    port = free_port()
    engine = LaunchedSGLangEngine(
        "/models/m",
        port=port,
        admin_key=ADMIN_KEY,
        api_key=API_KEY,
        env={"PYTHONPATH": str(tmp_path), "STANDIN_SCRIPT": SERVER_SCRIPT},
        startup_timeout=20.0,
        timeouts=HTTPTimeouts(probe=2.0),
    )
    engines.append(engine)
    with structlog.testing.capture_logs() as events:
        await engine.start()
        assert engine.pid is not None
        assert_no_key(await asyncio.to_thread(command_line, engine.pid))
        assert await engine.weight_version() == "v0"
        await engine.close()
    lines = [e["line"] for e in events if e["event"] == "sglang.log"]
    assert "memory_saver=True admin=******** api=******** env_has_key=False" in lines
    for event in events:
        assert_no_key(repr(event))


def test_launched_engine_never_imports_sglang() -> None:
    assert "sglang" not in sys.modules
    assert ADMIN_KEY_ENV == "ROLLOUT_LIFECYCLE_ADMIN_API_KEY"


# --------------------------------------------------------------------------------- the idle barrier


def sglang_flush(paused_with_waiting: bool) -> Handler:
    """``/flush_cache`` as SGLang 0.5.23 answers it (flush_wrapper.py SchedulerFlushWrapper):
    with ``?timeout=T`` > 0 on an engine whose waiting queue holds retracted requests the
    deferred re-check never passes (400 after T); with no timeout it flushes at once, the
    waiting queue ignored while paused (scheduler.py flush_cache)."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/flush_cache":
            timeout = float(request.url.params.get("timeout", "0"))
            if timeout > 0 and paused_with_waiting:
                return httpx.Response(400, text="Timed out waiting for idle state.")
            return httpx.Response(200, text="Cache flushed.\n")
        return default_answer(request)

    return handler


async def test_the_idle_barrier_passes_after_a_retract_pause_on_sglang() -> None:
    server = FakeServer(sglang_flush(paused_with_waiting=True))
    host = EngineHost(make_engine(server))
    assert await host.flush_cache(deadline=0.5, retry_interval=0.01) == 1
    assert [dict(r.url.params) for r in server.requests] == [{}]


async def test_a_timed_flush_still_sends_its_timeout_for_an_unpaused_engine() -> None:
    # flush_cache(T > 0) waits server-side for an unpaused engine to go idle; it is not the
    # barrier, and it is what SGLang refuses after a retract pause.
    server = FakeServer(sglang_flush(paused_with_waiting=True))
    engine = make_engine(server)
    with pytest.raises(EngineRejected, match="Timed out waiting for idle state") as info:
        await engine.flush_cache(0.2)
    assert info.value.status == 400
    assert server.requests[0].url.params["timeout"] == "0.2"


class PausedWithWaiting(SimulatedEngine):
    """A backend whose engine is paused with retracted requests in its waiting queue: its flush
    answers 400 whenever a server-side timeout is asked for, 200 without one."""

    def __init__(self) -> None:
        super().__init__("paused-with-waiting")
        self.timeouts: list[float] = []

    async def flush_cache(self, timeout: float) -> None:
        self.timeouts.append(timeout)
        if timeout > 0:
            raise EngineRejected(self.label, "flush_cache", "Timed out waiting for idle state.")


async def test_engine_host_flushes_with_no_server_side_timeout() -> None:
    backend = PausedWithWaiting()
    host = EngineHost(backend)
    assert await host.flush_cache(deadline=0.5, retry_interval=0.01) == 1
    assert backend.timeouts == [0.0]


# --------------------------------------------------------------------------------- the selector


async def test_a_session_already_open_is_refused_as_session_open_and_other_400s_as_they_are() -> (
    None
):
    # sglang: weight_updater.py begin_weight_update answers 400 with its text; every backend
    # refuses a session already open with SESSION_OPEN, which the lifecycle closes and retries.
    def answer(message: str) -> Handler:
        return lambda _: httpx.Response(400, json={"success": False, "message": message})

    engine = make_engine(FakeServer(answer(SESSION_ALREADY_OPEN)))
    with pytest.raises(EngineRejected) as open_already:
        await engine.begin_weight_update()
    assert open_already.value.status == SESSION_OPEN
    assert SESSION_ALREADY_OPEN in open_already.value.message
    other = make_engine(FakeServer(answer("selector must be one of all, draft")))
    with pytest.raises(EngineRejected) as refused:
        await other.begin_weight_update()
    assert refused.value.status == 400


async def test_one_selector_goes_to_begin_and_to_every_update() -> None:
    server = FakeServer()
    engine = make_engine(server, weight_selector="draft")
    assert engine.weight_selector == "draft"
    await engine.begin_weight_update()
    await engine.update_weights_from_tensor(
        ["b64"], weight_version=None, flush_cache=False, abort_all_requests=False
    )
    await engine.update_weights_from_distributed(
        ["w"],
        ["bfloat16"],
        [[2]],
        "g",
        weight_version=None,
        flush_cache=False,
        abort_all_requests=False,
    )
    await engine.end_weight_update()
    selectors = [json.loads(r.content).get("selector") for r in server.requests]
    assert selectors == ["draft", "draft", "draft", None]
    default = FakeServer()
    plain = make_engine(default)
    await plain.begin_weight_update()
    await plain.update_weights_from_tensor(
        ["b64"], weight_version=None, flush_cache=False, abort_all_requests=False
    )
    # SGLang's own default (io_struct.py BeginWeightUpdateReqInput.selector = "all").
    assert [json.loads(r.content)["selector"] for r in default.requests] == ["all", "all"]
    with pytest.raises(InvalidArgument, match="weight_selector"):
        make_engine(FakeServer(), weight_selector="both")


# --------------------------------------------------------------------------------- readiness


async def test_ready_probes_slash_ready_without_a_key() -> None:
    def warming(request: httpx.Request) -> httpx.Response:
        # SGLang before warm-up or while paused: /model_info answers, /ready is 503.
        if request.url.path == "/ready":
            return httpx.Response(503)
        return default_answer(request)

    server = FakeServer(warming)
    engine = make_engine(server, admin_key=ADMIN_KEY)
    assert await engine.ready() is False
    assert server.paths == ["/ready"]
    assert "authorization" not in server.requests[0].headers
    up = FakeServer()
    assert await make_engine(up, admin_key=ADMIN_KEY).ready() is True
    assert up.paths == ["/ready"]


# --------------------------------------------------------------------------------- attach check


def reporting(version: Any) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            info = {"internal_states": [{}], "api_key": API_KEY}
            if version is not None:
                info["version"] = version
            return httpx.Response(200, json=info)
        return default_answer(request)

    return handler


@pytest.mark.parametrize(
    ("version", "said"),
    [
        ("0.5.21", "'0.5.21', older than 0.5.22"),
        ("0.5.20", "'0.5.20', older than 0.5.22"),
        ("0.4.9.post2", "'0.4.9.post2', older"),
        (None, "reports no SGLang version"),
        ("banana", "'banana', which is not a version number"),
        (23, "23, which is not a version number"),
    ],
)
async def test_an_old_or_unknown_sglang_is_refused_before_any_lifecycle_call(
    version: Any, said: str
) -> None:
    server = FakeServer(reporting(version))
    engine = make_engine(server, check_version=True, api_key=API_KEY)
    with pytest.raises(IllegalEngineOp) as info:
        await engine.pause_generation(PauseMode.RETRACT)
    assert said in str(info.value)
    assert info.value.op == "pause_generation"
    assert_no_key(str(info.value))
    with pytest.raises(IllegalEngineOp):
        await engine.release_memory_occupation([Tag.KV_CACHE])
    assert server.paths == ["/server_info", "/server_info"]  # nothing else was sent
    assert engine.sglang_version is None


@pytest.mark.parametrize("version", ["0.5.22", "0.5.23", "0.5.23.post1", "0.5.23-sim", "0.6.0"])
async def test_a_supported_sglang_is_checked_once_then_driven(version: str) -> None:
    server = FakeServer(reporting(version))
    engine = make_engine(server, check_version=True)
    await engine.pause_generation(PauseMode.RETRACT)
    await engine.flush_cache(0.0)
    await engine.continue_generation()
    assert server.paths == [
        "/server_info",
        "/pause_generation",
        "/flush_cache",
        "/continue_generation",
    ]
    assert engine.sglang_version == version


async def test_probes_and_requests_do_not_wait_for_the_attach_check() -> None:
    server = FakeServer(reporting("0.5.20"))
    engine = make_engine(server, check_version=True)
    await engine.weight_version()
    await engine.generate({"text": "x"})
    await engine.abort_request("req-1")
    assert await engine.ready()
    assert server.paths == ["/model_info", "/generate", "/abort_request", "/ready"]
    with pytest.raises(IllegalEngineOp, match=r"0\.5\.20"):
        await engine.check_version()


def test_versions_parse_by_their_leading_numbers() -> None:
    assert parse_version("0.5.23") == (0, 5, 23)
    assert parse_version("0.5.23rc1") == (0, 5, 23)
    assert parse_version("0.6") == (0, 6, 0)
    assert parse_version("v1.2.3") == (1, 2, 3)
    assert parse_version("dev") is None
    assert parse_version(None) is None


# --------------------------------------------------------------------------------- weight groups


async def test_weight_group_calls_are_sent_once_and_checked() -> None:
    server = FakeServer(failing(1, raising(httpx.ReadError)))
    engine = make_engine(server, retries=5)
    with pytest.raises(EngineUnreachable):
        await engine.init_weights_update_group("10.0.0.5", 29500, 1, 2)
    assert len(server.requests) == 1  # a second join would form a second group
    refused = FakeServer(
        lambda r: httpx.Response(400, json={"success": False, "message": "no such group"})
    )
    with pytest.raises(EngineRejected, match="no such group"):
        await make_engine(refused).destroy_weights_update_group("g")
    bad = FakeServer()
    for args in [("", 29500, 1, 2), ("h", 0, 1, 2), ("h", 29500, 0, 2), ("h", 29500, 2, 2)]:
        with pytest.raises(InvalidArgument):
            await make_engine(bad).init_weights_update_group(*args)
    assert bad.requests == []


async def test_the_host_passes_weight_group_calls_and_load_format_through() -> None:
    server = FakeServer()
    host = EngineHost(make_engine(server))
    await host.init_weights_update_group("10.0.0.5", 29500, 3, 5, "g", "gloo")
    await host.update_weights_from_distributed(
        ["w"], ["float32"], [[4]], "g", "v2", False, "direct"
    )
    await host.destroy_weights_update_group("g")
    assert server.paths == [
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
    ]
    bodies = [json.loads(r.content) for r in server.requests]
    assert bodies[0]["rank_offset"] == 3 and bodies[0]["backend"] == "gloo"
    assert bodies[1]["load_format"] == "direct" and bodies[1]["abort_all_requests"] is False
    assert bodies[2] == {"group_name": "g"}


# --------------------------------------------------------------------------------- launch


async def test_a_launched_server_is_ready_only_when_slash_ready_says_so(
    engines: list[LaunchedSGLangEngine],
) -> None:
    # /model_info answers before warm-up; /ready stays 503 until the server is up.
    engine = launched(free_port(), "warming", startup_timeout=1.0)
    engines.append(engine)
    with pytest.raises(EngineTimeout, match="not ready within 1s"):
        await engine.start()
    assert engine.returncode is not None


async def test_a_launched_old_sglang_is_refused_and_stopped(
    engines: list[LaunchedSGLangEngine],
) -> None:
    engine = launched(free_port(), "old")
    engines.append(engine)
    with pytest.raises(IllegalEngineOp, match=r"'0\.5\.20', older than 0\.5\.22"):
        await engine.start()
    assert engine.returncode is not None
    with pytest.raises(EngineDead, match=r"start failed earlier.*0\.5\.20"):
        await engine.pause_generation(PauseMode.RETRACT)
    await engine.close()


async def test_every_call_sends_what_its_row_of_the_endpoint_table_declares() -> None:
    """Method, path and body fields of each call, read back against ``sglang.api``: a body
    key the row does not declare would be ignored by SGLang without a word."""
    server = FakeServer()
    engine = make_engine(server)
    for _, call, *_ in WIRE_CASES:
        await call(engine)
    await engine.close()
    seen = set()
    for request in server.requests:
        row = BY_PATH[request.url.path]
        seen.add(row.name)
        assert request.method == row.method, row.name
        declared = {f.name for f in row.fields}
        assert set(request.url.params) <= declared, row.name
        if request.content and row.fields:
            assert set(json.loads(request.content)) <= declared, row.name
    assert {"pause_generation", "flush_cache", "update_weights_from_distributed"} <= seen


async def test_a_body_field_the_table_does_not_declare_is_refused_before_sending() -> None:
    server = FakeServer()
    engine = make_engine(server)
    with pytest.raises(AssertionError, match="no field \\['modes'\\]"):
        await engine.link.call("pause_generation", {"modes": "abort"})
    assert server.requests == []
    await engine.close()


async def test_a_tensor_parallel_engines_ranks_are_told_apart_by_prefix() -> None:
    def two_ranks(request: httpx.Request) -> httpx.Response:
        ranks = [{"checksums": {"w": digest}} for digest in ("aa", "bb")]
        return httpx.Response(200, json={"success": True, "ranks": ranks})

    engine = make_engine(FakeServer(two_ranks))
    assert (await engine.weight_fingerprint())["tensors"] == {"tp0:w": "aa", "tp1:w": "bb"}


def checker(*ranks: tuple[dict[str, int], str]) -> httpx.Response:
    """A ``/weights_checker`` answer of ranks, each (its placement, its digest of ``w``)."""
    body = [
        {"checksums": {"w": digest}, "parallelism_info": [{"role": "target", **place}]}
        for place, digest in ranks
    ]
    return httpx.Response(200, json={"success": True, "ranks": body})


@pytest.mark.parametrize(
    ("ranks", "tensors"),
    [
        # data-parallel replicas that agree: one set of weights (a real --dp-size 2 server)
        ((({"tp_rank": 0, "dp_rank": 0}, "aa"), ({"tp_rank": 0, "dp_rank": 1}, "aa")), {"w": "aa"}),
        # replicas that differ: each named, so no trainer's fingerprint matches
        (
            (({"tp_rank": 0, "dp_rank": 0}, "aa"), ({"tp_rank": 0, "dp_rank": 1}, "bb")),
            {"dp0:w": "aa", "dp1:w": "bb"},
        ),
        # two replicas of two shards
        (
            tuple(({"tp_rank": t, "dp_rank": d}, f"s{t}") for d in (0, 1) for t in (0, 1)),
            {"tp0:w": "s0", "tp1:w": "s1"},
        ),
        # pipeline stages are shards too
        (
            (({"pp_rank": 0, "tp_rank": 0}, "p0"), ({"pp_rank": 1, "tp_rank": 0}, "p1")),
            {"pp0:tp0:w": "p0", "pp1:tp0:w": "p1"},
        ),
    ],
)
async def test_data_parallel_replicas_are_one_fingerprint_when_they_agree(
    ranks: tuple[tuple[dict[str, int], str], ...], tensors: dict[str, str]
) -> None:
    engine = make_engine(FakeServer(lambda request: checker(*ranks)))
    assert (await engine.weight_fingerprint())["tensors"] == tensors
    await engine.close()


@pytest.mark.parametrize(
    ("info", "role"),
    [
        ({"version": "0.5.23", "disaggregation_mode": "null"}, ("regular", None)),
        ({"version": "0.5.23"}, ("regular", None)),  # (a server that predates the argument)
        (
            {"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 8998},
            ("prefill", 8998),
        ),
        (
            {"disaggregation_mode": "decode", "disaggregation_bootstrap_port": 8998},
            ("decode", None),
        ),
    ],
)
async def test_server_info_names_what_the_server_serves_as(
    info: dict[str, Any], role: tuple[str, int | None]
) -> None:
    engine = make_engine(FakeServer(lambda request: httpx.Response(200, json=info)))
    await engine.server_info()
    assert (engine.capabilities.worker_type, engine.capabilities.bootstrap_port) == role
    assert engine.capabilities.half == (role[0] != "regular")


@pytest.mark.parametrize(
    "info",
    [
        {"disaggregation_mode": "both"},
        {"disaggregation_mode": "prefill"},
        {"disaggregation_mode": "prefill", "disaggregation_bootstrap_port": "8998"},
    ],
    ids=["unknown_mode", "prefill_without_port", "port_not_int"],
)
async def test_a_disaggregation_mode_not_understood_is_a_garbage_answer(
    info: dict[str, Any],
) -> None:
    engine = make_engine(FakeServer(lambda request: httpx.Response(200, json=info)))
    with pytest.raises(EngineError, match=r"garbage answer.*disaggregation"):
        await engine.server_info()
