"""The stand-in's request validation: a request's body and query read against its row of the
endpoint table (``backends.sglang.api``), refused as SGLang's schema refuses them (400, with
pydantic's message), and SGLang's JSON error answer."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rollout_lifecycle.backends.http.rows import Endpoint, Field

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response


class BadRequest(Exception):
    """A body or query SGLang's request validation would refuse with 400."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _loc(field: Field | None) -> tuple[str, ...]:
    if field is None:
        return ("body",)
    return (field.where, field.name)


def _refused(*errors: str) -> BadRequest:
    """pydantic's text for ``errors`` (each one error's repr), as SGLang's 400 carries it."""
    count = f"{len(errors)} validation error" + ("" if len(errors) == 1 else "s")
    return BadRequest(f"{count}: [{', '.join(errors)}]")


def _missing(field: Field | None) -> str:
    return f"{{'type': 'missing', 'loc': {_loc(field)!r}, 'msg': 'Field required', 'input': None}}"


def _invalid(field: Field | None, kind: str, expected: str, value: object) -> str:
    return (
        f"{{'type': {kind!r}, 'loc': {_loc(field)!r}, "
        f"'msg': {'Input should be ' + expected!r}, 'input': {value!r}}}"
    )


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object; a missing, undecodable or non-object body is a 400."""
    raw = await request.body()
    if not raw.strip():
        raise _refused(_missing(None))
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise _refused(_invalid(None, "dict_type", "a valid dictionary or object", body))
    return body


class _Invalid(Exception):
    """One field's value refused (its error's text)."""


#: The plain kinds: the check a value passes, pydantic's error type and what it expected.
_PLAIN: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "str": (lambda v: isinstance(v, str), "string_type", "a valid string"),
    "int": (
        lambda v: isinstance(v, int) and not isinstance(v, bool),
        "int_type",
        "a valid integer",
    ),
    "list": (lambda v: isinstance(v, list), "list_type", "a valid list"),
    "tags": (
        lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v),
        "list_type",
        "a valid list of strings",
    ),
}


def _value(field: Field, raw: Any) -> Any:
    """``raw`` checked as ``field``'s kind (pydantic's lax rules where SGLang's schema has
    them); ``_Invalid`` if it is not one."""
    kind = field.kind
    if kind in _PLAIN:
        check, error_type, expected = _PLAIN[kind]
        if check(raw):
            return raw
        raise _Invalid(_invalid(field, error_type, expected, raw))
    if kind == "bool":
        if isinstance(raw, bool) or (isinstance(raw, int) and raw in (0, 1)):
            return bool(raw)
        raise _Invalid(_invalid(field, "bool_type", "a valid boolean", raw))
    if kind == "choice":
        if isinstance(raw, str) and raw in field.choices:
            return raw
        *head, last = field.choices
        allowed = ", ".join(repr(c) for c in head) + f" or {last!r}"
        raise _Invalid(_invalid(field, "literal_error", allowed, raw))
    try:
        number = float(raw)  # kind "number"
    except (TypeError, ValueError):
        raise _Invalid(_invalid(field, "float_parsing", "a valid number", raw)) from None
    if number < 0:
        raise _Invalid(_invalid(field, "greater_than_equal", "greater than or equal to 0", raw))
    return number


def fields_of(endpoint: Endpoint, body: Mapping[str, Any], query: Mapping[str, str]) -> Any:
    """Every field of ``endpoint``, by name: the value sent, checked, or the field's default.

    Fields the table does not know are ignored, as SGLang ignores unknown body keys.
    """
    values: dict[str, Any] = {}
    errors: list[str] = []
    for field in endpoint.fields:
        source: Mapping[str, Any] = body if field.where == "body" else query
        raw = source.get(field.name)
        if field.name not in source and field.required:
            errors.append(_missing(field))
        elif raw is None and (field.name not in source or field.nullable):
            values[field.name] = field.default
        else:
            try:
                values[field.name] = _value(field, raw)
            except _Invalid as exc:
                errors.append(str(exc))
    if errors:
        raise _refused(*errors)
    return values


async def read(endpoint: Endpoint, request: Request) -> dict[str, Any]:
    """The request's fields, read from its body (when the endpoint reads one) and query."""
    empty = endpoint.body_optional and not (await request.body()).strip()
    body = await json_body(request) if endpoint.reads_body and not empty else {}
    values: dict[str, Any] = fields_of(endpoint, body, request.query_params)
    return values


def error(message: str, status: int = 400) -> Response:
    """SGLang's JSON error answer (``http_server.py`` ``_create_error_response`` and its
    validation handler)."""
    from http import HTTPStatus

    from starlette.responses import JSONResponse

    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = str(status)
    body = {"object": "error", "message": message, "type": phrase, "param": None, "code": status}
    return JSONResponse(body, status_code=status)


__all__ = ["BadRequest", "error", "fields_of", "json_body", "read"]
