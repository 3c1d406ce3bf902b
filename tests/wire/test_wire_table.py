"""The endpoint table (``backends.sglang.api``) that the HTTP client sends from and the stand-in
serves from, checked row by row against the server (a stand-in and a real SGLang): every path of
every row is routed with the row's methods and refuses others, each row wants the key the table
says, and a body that lacks a required field or holds a value of the wrong kind is refused with
400 (naming the field) and changes nothing."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from wire.helpers import Target

from rollout_lifecycle.backends.http.rows import Auth, Endpoint, Field
from rollout_lifecycle.backends.sglang.api import ENDPOINTS, rows

ROWS = list(rows())
#: A value of the wrong kind for each kind of field.
WRONG: dict[str, object] = {
    "str": 7,
    "int": "seven",
    "bool": "maybe",
    "list": "not a list",
    "choice": "no-such-choice",
    "tags": "kv_cache",
}


def name(row: Endpoint) -> str:
    return row.name


async def still_serving(client: httpx.AsyncClient) -> None:
    """Nothing happened: still serving, nothing released (a one-token generation runs)."""
    assert (await client.get("/ready")).status_code == 200
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "ignore_eos": True}}
    out = await client.post("/generate", json=body)
    assert out.status_code == 200 and len(out.json()["output_ids"]) == 1, out.text


def test_the_table_names_each_path_once() -> None:
    paths = [path for row in ROWS for path in row.paths]
    assert len(paths) == len(set(paths))
    assert all(row.method in row.methods for row in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=name)
async def test_every_path_of_a_row_refuses_a_method_the_row_does_not_list(
    target: Target, row: Endpoint
) -> None:
    other = next(m for m in ("DELETE", "PATCH") if m not in row.methods)
    async with target.client() as client:
        for path in row.paths:
            answer = await client.request(other, path)
            assert answer.status_code == 405, (path, answer.status_code, answer.text)
        assert (await client.request(other, "/no_such_route")).status_code == 404


@pytest.mark.parametrize(
    "row",
    [r for r in ROWS if r.reads_body and not r.body_optional and r.auth is Auth.CONTROL],
    ids=name,
)
async def test_every_method_of_a_body_row_is_routed_and_refuses_no_body(
    target: Target, row: Endpoint
) -> None:
    async with target.client() as client:
        for method in row.methods:
            answer = await client.request(method, row.path)
            assert answer.status_code == 400, (method, answer.text)
            assert answer.json()["object"] == "error"
        await still_serving(client)


def _bad_bodies() -> list[Any]:
    cases = []
    for row in ROWS:
        if not (row.reads_body and row.auth is Auth.CONTROL) or row.body_optional:
            continue  # (a row whose body is optional has a scenario of its own)
        required = [f for f in row.fields if f.required]
        if required:
            cases.append(pytest.param(row, None, id=f"{row.name}-missing"))
        cases += [
            pytest.param(row, f, id=f"{row.name}-{f.name}")
            for f in row.fields
            if f.kind in WRONG and f.where == "body"
        ]
    return cases


@pytest.mark.parametrize(("row", "field"), _bad_bodies())
async def test_a_body_the_table_calls_wrong_is_a_400_naming_the_field(
    target: Target, row: Endpoint, field: Field | None
) -> None:
    """``field`` None: a body with no field at all, so every required field is missing; else a
    body whose ``field`` holds a value of the wrong kind (its required fields are missing too,
    so nothing can run)."""
    body = {} if field is None else {field.name: WRONG[field.kind]}
    named = [f.name for f in row.fields if f.required] + ([] if field is None else [field.name])
    async with target.client() as client:
        answer = await client.post(row.path, json=body)
        assert answer.status_code == 400, answer.text
        message = answer.json()["message"]
        for field_name in named:
            assert f"'{field_name}'" in message, (field_name, message)
        await still_serving(client)


@pytest.mark.parametrize("row", ROWS, ids=name)
async def test_every_row_wants_the_key_the_table_says(keyed: Target, row: Endpoint) -> None:
    """A wrong key is refused before the call runs (so this changes nothing); an open row takes
    no key at all."""
    assert keyed.admin_key and keyed.api_key
    wrong = {Auth.CONTROL: keyed.api_key, Auth.NORMAL: keyed.admin_key}
    async with httpx.AsyncClient(base_url=keyed.url, timeout=60, trust_env=False) as client:
        for path in row.paths:
            if row.auth is Auth.OPEN:
                answer = await client.request(row.method, path)
                assert answer.status_code != 401, (path, answer.text)
                continue
            answer = await client.request(row.method, path, headers=keyed.headers(wrong[row.auth]))
            assert answer.status_code == 401, (path, answer.status_code, answer.text)
            assert answer.json() == {"error": "Unauthorized"}


async def test_null_stands_for_the_default_only_where_the_table_says(target: Target) -> None:
    """An explicit ``null`` is the default for an ``Optional`` field (``rid``) and a 400 for any
    other (``torch_empty_cache``); both calls are harmless on a serving server."""
    abort, cont = ENDPOINTS["abort_request"], ENDPOINTS["continue_generation"]
    assert abort.field("rid").nullable and not cont.field("torch_empty_cache").nullable
    async with target.client() as client:
        answer = await client.post(abort.path, json={"rid": None, "abort_all": False})
        assert answer.status_code == 200, answer.text
        answer = await client.post(cont.path, json={"torch_empty_cache": None})
        assert answer.status_code == 400, answer.text
        assert "'torch_empty_cache'" in answer.json()["message"]
        await still_serving(client)
