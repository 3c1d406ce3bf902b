"""HTTP faults the stand-in injects on request (``/_standin/faults``): delays, a proxy's error
page, connections dropped before or after the engine ran the call, and sudden death. Tests of
what a client does when the network or the server misbehaves post rules here."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from rollout_lifecycle.testing.standin.bodies import BadRequest

if TYPE_CHECKING:
    from starlette.responses import Response
    from starlette.types import ASGIApp, Receive, Scope, Send

#: Where fault rules are posted, listed and cleared (stand-in only; SGLang has no such route).
FAULTS_PATH = "/_standin/faults"
#: What an injected fault does to a request to its path (GET or POST): ``delay`` sleeps, then
#: handles the request normally; ``status`` answers an error status (a proxy's error page)
#: without touching the engine; ``drop`` drops the connection without touching the engine;
#: ``drop_after`` runs the call on the engine, then drops the connection instead of answering;
#: ``die`` kills the server at once (exit ``DEATH_EXIT_CODE``), without answering.
FAULT_KINDS: tuple[str, ...] = ("delay", "status", "drop", "drop_after", "die")
_FAULT_FIELDS = ("path", "kind", "count", "seconds", "status")
#: The body length a dropped response announces and never delivers.
_DROP_ANNOUNCED_BYTES = 64


class _ConnectionDropped(Exception):
    """Raised once a response has started: uvicorn then closes the connection mid-response."""


class QuietDrops(logging.Filter):
    """Keeps uvicorn from logging an injected drop as an application error."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, _ConnectionDropped)


@dataclass
class FaultRule:
    """One injected fault: what happens to the next ``count`` requests to ``path``."""

    path: str
    kind: str
    #: Requests still to hit; -1 forever.
    count: int
    seconds: float | None = None
    status: int | None = None
    applied: int = 0

    def take(self) -> None:
        """Count one application."""
        self.applied += 1
        if self.count > 0:
            self.count -= 1

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "kind": self.kind, "count": self.count}
        if self.seconds is not None:
            out["seconds"] = self.seconds
        if self.status is not None:
            out["status"] = self.status
        out["applied"] = self.applied
        return out


def _fault_rule(index: int, raw: object, paths: Collection[str]) -> FaultRule:
    where = f"fault rule #{index}"
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be a JSON object, got {raw!r}")
    unknown = [k for k in raw if k not in _FAULT_FIELDS]
    if unknown:
        raise BadRequest(
            f"{where}: unknown field {unknown[0]!r}; fields: {', '.join(_FAULT_FIELDS)}"
        )
    path = raw.get("path")
    if not isinstance(path, str) or path not in paths:
        valid = ", ".join(sorted(paths))
        raise BadRequest(f"{where}: unknown path {path!r}; faults apply to: {valid}")
    kind = raw.get("kind")
    if not isinstance(kind, str) or kind not in FAULT_KINDS:
        raise BadRequest(f"{where}: unknown kind {kind!r}; valid: {', '.join(FAULT_KINDS)}")
    count = raw.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or (count < 1 and count != -1):
        raise BadRequest(f"{where}: count must be an int >= 1 or -1 (forever), got {count!r}")
    seconds = raw.get("seconds")
    if kind == "delay":
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not math.isfinite(seconds)
            or seconds < 0
        ):
            raise BadRequest(
                f"{where}: a delay needs seconds, a finite number >= 0, got {seconds!r}"
            )
        seconds = float(seconds)
    elif seconds is not None:
        raise BadRequest(f"{where}: seconds applies to kind 'delay' only, not {kind!r}")
    status = raw.get("status")
    if kind == "status":
        status = 502 if status is None else status
        if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
            raise BadRequest(f"{where}: status must be an int in 400..599, got {status!r}")
    elif status is not None:
        raise BadRequest(f"{where}: status applies to kind 'status' only, not {kind!r}")
    return FaultRule(path=path, kind=kind, count=count, seconds=seconds, status=status)


def parse_fault_rules(body: object, paths: Collection[str]) -> list[FaultRule]:
    """The rules of a ``POST /_standin/faults`` body (a list, or ``{"faults": [...]}``).

    All or nothing: the first bad rule raises, naming its index and the bad value.
    """
    rules = body
    if isinstance(body, dict):
        if set(body) != {"faults"}:
            raise BadRequest(
                f'an object body must be {{"faults": [...]}} alone, got keys {list(body)}'
            )
        rules = body["faults"]
    if not isinstance(rules, list):
        raise BadRequest(
            f'faults must be a JSON list of rules or an object {{"faults": [...]}}, got {rules!r}'
        )
    return [_fault_rule(i, raw, paths) for i, raw in enumerate(rules)]


def _proxy_error_page(status: int) -> Response:
    """What a reverse proxy answers when its upstream cannot: an HTML error page."""
    from http import HTTPStatus

    from starlette.responses import HTMLResponse

    try:
        title = f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        title = str(status)
    page = (
        f"<html>\r\n<head><title>{title}</title></head>\r\n<body>\r\n"
        f"<center><h1>{title}</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"
    )
    return HTMLResponse(page, status_code=status)


async def _read_body(receive: Receive) -> None:
    """Consume the request body nobody else will read.

    Closing a socket with unread input makes the kernel reset the connection, and the client
    then sees a reset (``ReadError``) or a clean close depending on timing; read first, and
    every drop looks the same to the client.
    """
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


async def _drop(send: Send, why: str) -> NoReturn:
    """Start a response, then fail: the server closes the connection with nothing delivered.

    The client reads a status line and headers announcing a body that never comes, so it sees a
    transport error (httpx: ``RemoteProtocolError``), never an HTTP answer it could act on.
    """
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(_DROP_ANNOUNCED_BYTES).encode("ascii")),
            ],
        }
    )
    raise _ConnectionDropped(why)


class FaultState(Protocol):
    """What ``FaultMiddleware`` works on: the rules in force, the log of the faults applied and
    the server's death (a stand-in's shared state, ``app.StandInState``)."""

    def take_fault(self, path: str) -> FaultRule | None:
        """The rule the request to ``path`` meets, counted now; None when none matches."""
        ...

    def record_fault(self, rule: FaultRule, method: str, start: float, detail: str) -> None:
        """Log one applied fault."""
        ...

    def kill(self, reason: str) -> NoReturn:
        """Kill the engine and the server (an injected ``die``)."""
        ...


class FaultMiddleware:
    """Applies the injected fault rules (pure ASGI: it must control the raw connection)."""

    def __init__(self, app: ASGIApp, *, state: FaultState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rule = self.state.take_fault(scope["path"]) if scope["type"] == "http" else None
        if rule is None:
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        method, path = scope["method"], scope["path"]
        if rule.kind == "delay":
            assert rule.seconds is not None
            await asyncio.sleep(rule.seconds)
            self.state.record_fault(rule, method, start, f"delayed {rule.seconds:g}s")
            await self.app(scope, receive, send)
        elif rule.kind == "status":
            assert rule.status is not None
            await _read_body(receive)  # a proxy takes the whole request before it answers
            self.state.record_fault(rule, method, start, f"answered {rule.status}")
            await _proxy_error_page(rule.status)(scope, receive, send)
        elif rule.kind == "drop":
            await _read_body(receive)
            self.state.record_fault(rule, method, start, "connection dropped, engine untouched")
            await _drop(send, f"injected drop on {path}")
        elif rule.kind == "drop_after":
            answered: list[int] = []

            async def swallow(message: Any) -> None:
                if message["type"] == "http.response.start":
                    answered.append(int(message["status"]))

            await self.app(scope, receive, swallow)
            status = answered[0] if answered else None
            detail = f"the call ran and answered {status}; connection dropped instead"
            self.state.record_fault(rule, method, start, detail)
            await _drop(send, f"injected drop after {path}")
        else:  # die, once the request is in, as a handler that kills the engine would
            await _read_body(receive)
            self.state.record_fault(rule, method, start, "server killed")
            self.state.kill(f"injected fault 'die' on {method} {path}")


__all__ = [
    "FAULTS_PATH",
    "FAULT_KINDS",
    "FaultMiddleware",
    "FaultRule",
    "FaultState",
    "QuietDrops",
    "parse_fault_rules",
]
