"""Keys on a server started with both an api key and an admin key: only ``Authorization:
Bearer KEY`` counts; control endpoints take the admin key only, normal endpoints the api key
only; probes are open."""

from __future__ import annotations

import httpx
import pytest
from wire.helpers import Target

UNAUTHORIZED = {"error": "Unauthorized"}
#: Control endpoints whose call is harmless on a serving server.
CONTROL = [("POST", "/flush_cache", None), ("POST", "/continue_generation", {})]
NORMAL = [
    ("GET", "/model_info", None),
    ("GET", "/server_info", None),
    (
        "POST",
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}},
    ),
]


async def call(
    target: Target, method: str, path: str, body: object, headers: dict[str, str]
) -> httpx.Response:
    async with httpx.AsyncClient(base_url=target.url, timeout=60, trust_env=False) as client:
        if body is None:
            return await client.request(method, path, headers=headers)
        return await client.request(method, path, json=body, headers=headers)


def assert_unauthorized(answer: httpx.Response) -> None:
    assert answer.status_code == 401, answer.text
    assert answer.json() == UNAUTHORIZED


@pytest.mark.parametrize(("method", "path", "body"), CONTROL)
async def test_control_endpoints_take_the_admin_key_and_refuse_the_api_key(
    keyed: Target, method: str, path: str, body: object
) -> None:
    assert keyed.admin_key and keyed.api_key
    ok = await call(keyed, method, path, body, keyed.headers(keyed.admin_key))
    assert ok.status_code == 200, ok.text
    lower = await call(keyed, method, path, body, {"Authorization": f"bearer {keyed.admin_key}"})
    assert lower.status_code == 200, "the scheme is case-insensitive"
    assert_unauthorized(await call(keyed, method, path, body, keyed.headers(keyed.api_key)))
    assert_unauthorized(await call(keyed, method, path, body, {}))
    assert_unauthorized(await call(keyed, method, path, body, {"X-API-Key": keyed.admin_key}))
    assert_unauthorized(await call(keyed, method, path, body, {"Authorization": keyed.admin_key}))


@pytest.mark.parametrize(("method", "path", "body"), NORMAL)
async def test_normal_endpoints_take_the_api_key_and_refuse_the_admin_key(
    keyed: Target, method: str, path: str, body: object
) -> None:
    assert keyed.admin_key and keyed.api_key
    ok = await call(keyed, method, path, body, keyed.headers(keyed.api_key))
    assert ok.status_code == 200, ok.text
    assert_unauthorized(await call(keyed, method, path, body, keyed.headers(keyed.admin_key)))
    assert_unauthorized(await call(keyed, method, path, body, {}))
    assert_unauthorized(await call(keyed, method, path, body, {"X-API-Key": keyed.api_key}))


@pytest.mark.parametrize("path", ["/health", "/health_generate", "/ready"])
async def test_probes_need_no_key(keyed: Target, path: str) -> None:
    answer = await call(keyed, "GET", path, None, {})
    assert answer.status_code == 200, answer.text


async def test_a_refused_control_call_does_nothing(keyed: Target) -> None:
    answer = await call(keyed, "POST", "/pause_generation", {"mode": "abort"}, {})
    assert_unauthorized(answer)
    assert (await call(keyed, "GET", "/ready", None, {})).status_code == 200
