"""A stand-in SGLang 0.5.23 HTTP server: the simulated engine behind SGLang's routes, no GPU needed.

It answers like SGLang and dies like SGLang (the fatal call's connection drops, the port closes).
Stand-in only, under ``/_standin/``: the engine's history, memory and counters, and HTTP fault
injection (``/_standin/faults``: delays, proxy errors, dropped connections, sudden death) for
tests of what a client does when the network or the server misbehaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, NoReturn, TypeVar

from rollout_lifecycle.backends.secret import Secret, as_secret
from rollout_lifecycle.contract.exceptions import (
    EngineDead,
    EngineRejected,
    InvalidArgument,
    LifecycleError,
)
from rollout_lifecycle.contract.values import DEFAULT_GROUP_NAME, check_flag, check_seconds
from rollout_lifecycle.testing.simulated import (
    FLUSH_FAILED,
    WEIGHTS_WRITTEN_FLUSH_FAILED,
    SimulatedEngine,
    check_engine_options,
)

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.types import ASGIApp, Receive, Scope, Send

    _Handler = Callable[[Request], Awaitable[Response]]

T = TypeVar("T")

#: The one line ``serve`` prints on stdout once the server accepts connections.
READY_PREFIX = "FAKE_SGLANG_READY"
#: Exit status of a stand-in whose engine died (SGLang's process dies with its scheduler).
DEATH_EXIT_CODE = 70
#: How long ``StandInServer.start`` waits for the child to accept connections by default: a
#: child imports FastAPI, uvicorn and this package, which on a loaded 2-core CI machine has
#: been seen to take more than 30 s.
DEFAULT_STARTUP_TIMEOUT = 120.0
#: How long a child that has exited is given for its last stdout line to be read.
_EXIT_READ_GRACE_S = 5.0
#: Environment variables through which ``StandInServer`` hands keys to its subprocess.
ADMIN_KEY_ENV = "ROLLOUT_LIFECYCLE_STANDIN_ADMIN_KEY"
API_KEY_ENV = "ROLLOUT_LIFECYCLE_STANDIN_API_KEY"
DEFAULT_MODEL_PATH = "simulated/fake-sglang"

AuthLevel = Literal["open", "control", "normal"]

#: SGLang never asks for a key on these prefixes (probes and Prometheus scraping).
OPEN_PREFIXES: tuple[str, ...] = ("/health", "/ready", "/metrics")
#: SGLang's ADMIN_OPTIONAL endpoints: the admin key when one is configured, else the api key.
# sglang: http_server.py (@auth_level(AuthLevel.ADMIN_OPTIONAL) on each of these routes)
CONTROL_PATHS: frozenset[str] = frozenset(
    {
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
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
    }
)

_PAUSE_MODES = ("abort", "retract", "in_place")
_SELECTORS = ("target", "draft", "all")
_FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
_DEATH_POLL_S = 0.05

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


class StandInFailed(LifecycleError, RuntimeError):
    """A stand-in server process could not be started (or exited before it was ready)."""


class StandInDied(LifecycleError, RuntimeError):
    """Raised by an in-process app whose engine died when no ``on_death`` ended the process."""


class _BadRequest(Exception):
    """A body or query SGLang's request validation would refuse with 400."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# --------------------------------------------------------------------------------- auth


def auth_level(path: str) -> AuthLevel:
    """SGLang's auth level of ``path``: always open, control (admin optional) or normal."""
    if path.startswith(OPEN_PREFIXES):
        return "open"
    return "control" if path in CONTROL_PATHS else "normal"


def _token_matches(authorization: str | None, expected: str) -> bool:
    """``Authorization: Bearer <expected>``, nothing else (no ``X-API-Key``, no other scheme)."""
    # sglang: utils/auth.py decide_request_auth._check_bearer_token
    if not authorization:
        return False
    scheme, sep, token = authorization.partition(" ")
    if not sep or scheme.lower() != "bearer":
        return False
    # Starlette decodes header bytes as latin-1; re-encoding gives back the wire bytes.
    return hmac.compare_digest(token.encode("latin-1", "replace"), expected.encode("utf-8"))


def request_allowed(
    path: str,
    authorization: str | None,
    *,
    api_key: str | Secret | None,
    admin_key: str | Secret | None,
) -> bool:
    """SGLang's decision: may a request to ``path`` with this ``Authorization`` header pass?
    (401 ``{"error": "Unauthorized"}`` if not)."""
    # sglang: utils/auth.py decide_request_auth (ADMIN_OPTIONAL and NORMAL levels)
    level = auth_level(path)
    api = as_secret(api_key, what="api_key")
    admin = as_secret(admin_key, what="admin_key")
    if level == "open":
        return True
    # Control: the admin key when one is configured (the api key is then refused), else the api
    # key. Normal: the api key, even when an admin key exists.
    key = (admin or api) if level == "control" else api
    return key is None or _token_matches(authorization, key.reveal())


class _AuthMiddleware:
    """Pure ASGI middleware (keeps client-disconnect events intact, as SGLang's does)."""

    def __init__(self, app: ASGIApp, *, api_key: Secret | None, admin_key: Secret | None) -> None:
        self.app = app
        self.api_key = api_key
        self.admin_key = admin_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        from starlette.datastructures import Headers
        from starlette.responses import JSONResponse

        headers = Headers(scope=scope)
        if not request_allowed(
            scope["path"],
            headers.get("authorization"),
            api_key=self.api_key,
            admin_key=self.admin_key,
        ):
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


# --------------------------------------------------------------------------------- faults


class _ConnectionDropped(Exception):
    """Raised once a response has started: uvicorn then closes the connection mid-response."""


class _QuietDrops(logging.Filter):
    """Keeps uvicorn from logging an injected drop as an application error."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, _ConnectionDropped)


@dataclass
class _FaultRule:
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


def _fault_rule(index: int, raw: object, paths: Collection[str]) -> _FaultRule:
    where = f"fault rule #{index}"
    if not isinstance(raw, dict):
        raise _BadRequest(f"{where} must be a JSON object, got {raw!r}")
    unknown = [k for k in raw if k not in _FAULT_FIELDS]
    if unknown:
        raise _BadRequest(
            f"{where}: unknown field {unknown[0]!r}; fields: {', '.join(_FAULT_FIELDS)}"
        )
    path = raw.get("path")
    if not isinstance(path, str) or path not in paths:
        valid = ", ".join(sorted(paths))
        raise _BadRequest(f"{where}: unknown path {path!r}; faults apply to: {valid}")
    kind = raw.get("kind")
    if not isinstance(kind, str) or kind not in FAULT_KINDS:
        raise _BadRequest(f"{where}: unknown kind {kind!r}; valid: {', '.join(FAULT_KINDS)}")
    count = raw.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or (count < 1 and count != -1):
        raise _BadRequest(f"{where}: count must be an int >= 1 or -1 (forever), got {count!r}")
    seconds = raw.get("seconds")
    if kind == "delay":
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not math.isfinite(seconds)
            or seconds < 0
        ):
            raise _BadRequest(
                f"{where}: a delay needs seconds, a finite number >= 0, got {seconds!r}"
            )
        seconds = float(seconds)
    elif seconds is not None:
        raise _BadRequest(f"{where}: seconds applies to kind 'delay' only, not {kind!r}")
    status = raw.get("status")
    if kind == "status":
        status = 502 if status is None else status
        if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
            raise _BadRequest(f"{where}: status must be an int in 400..599, got {status!r}")
    elif status is not None:
        raise _BadRequest(f"{where}: status applies to kind 'status' only, not {kind!r}")
    return _FaultRule(path=path, kind=kind, count=count, seconds=seconds, status=status)


def _parse_fault_rules(body: object, paths: Collection[str]) -> list[_FaultRule]:
    """The rules of a ``POST /_standin/faults`` body (a list, or ``{"faults": [...]}``).

    All or nothing: the first bad rule raises, naming its index and the bad value.
    """
    rules = body
    if isinstance(body, dict):
        if set(body) != {"faults"}:
            raise _BadRequest(
                f'an object body must be {{"faults": [...]}} alone, got keys {list(body)}'
            )
        rules = body["faults"]
    if not isinstance(rules, list):
        raise _BadRequest(
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


class _FaultMiddleware:
    """Applies the injected fault rules (pure ASGI: it must control the raw connection)."""

    def __init__(self, app: ASGIApp, *, state: _StandIn) -> None:
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


# --------------------------------------------------------------------------------- bodies


def _missing(field: str) -> _BadRequest:
    loc = ("body",) if field == "" else ("body", field)
    return _BadRequest(
        f"1 validation error: [{{'type': 'missing', 'loc': {loc!r}, 'msg': 'Field required', "
        "'input': None}]"
    )


def _invalid(field: str, kind: str, expected: str, value: object) -> _BadRequest:
    loc = ("body",) if field == "" else ("body", field)
    return _BadRequest(
        f"1 validation error: [{{'type': {kind!r}, 'loc': {loc!r}, "
        f"'msg': {'Input should be ' + expected!r}, 'input': {value!r}}}]"
    )


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        raise _missing("")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise _BadRequest(f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise _invalid("", "dict_type", "a valid dictionary or object", body)
    return body


def _bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):  # pydantic's lax bool
        return bool(value)
    raise _invalid(key, "bool_type", "a valid boolean", value)


def _opt_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None or isinstance(value, str):
        return value
    raise _invalid(key, "string_type", "a valid string", value)


def _req(body: Mapping[str, Any], key: str) -> Any:
    if key not in body:
        raise _missing(key)
    return body[key]


def _req_str(body: Mapping[str, Any], key: str) -> str:
    value = _req(body, key)
    if not isinstance(value, str):
        raise _invalid(key, "string_type", "a valid string", value)
    return value


def _req_int(body: Mapping[str, Any], key: str) -> int:
    value = _req(body, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(key, "int_type", "a valid integer", value)
    return value


def _req_list(body: Mapping[str, Any], key: str) -> list[Any]:
    value = _req(body, key)
    if not isinstance(value, list):
        raise _invalid(key, "list_type", "a valid list", value)
    return value


def _choice(body: Mapping[str, Any], key: str, choices: Sequence[str], default: str) -> str:
    value = body.get(key, default)
    if isinstance(value, str) and value in choices:
        return value
    allowed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
    raise _invalid(key, "literal_error", allowed, value)


def _tags(body: Mapping[str, Any]) -> list[str] | None:
    tags = body.get("tags")
    if tags is None:
        return None
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise _invalid("tags", "list_type", "a valid list of strings", tags)
    return tags


# --------------------------------------------------------------------------------- the app


class _StandIn:
    """What the routes share: the engine, death handling and the history file."""

    def __init__(
        self,
        engine: SimulatedEngine,
        *,
        on_death: Callable[[], None] | None,
        history_file: str | None,
        model_path: str,
    ) -> None:
        self.engine = engine
        self.on_death = on_death
        self.history_path = None if history_file is None else Path(history_file)
        self.model_path = model_path
        self.initial_model_path = model_path
        self._written: set[tuple[str, float]] = set()
        self._death_written = False
        self._dying = False
        #: Paths of the app's routes (the paths a fault rule may name).
        self.routes: set[str] = set()
        #: Fault rules in force, first match wins; a rule leaves once its count is spent.
        self.faults: list[_FaultRule] = []
        #: Every fault applied so far, as history entries (``op`` ``"fault"``).
        self.fault_log: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ faults

    def take_fault(self, path: str) -> _FaultRule | None:
        """The rule the request to ``path`` meets, counted now; None when none matches."""
        for rule in self.faults:
            if rule.path == path:
                rule.take()
                if rule.count == 0:
                    self.faults.remove(rule)
                return rule
        return None

    def record_fault(self, rule: _FaultRule, method: str, start: float, detail: str) -> None:
        """Log one applied fault in the history (and its file, at once)."""
        entry = {
            "op": "fault",
            "engine": self.engine.label,
            "kind": rule.kind,
            "path": rule.path,
            "method": method,
            "tags": None,
            "mode": None,
            "start": start,
            "end": time.monotonic(),
            "outcome": "injected",
            "detail": detail,
        }
        self.fault_log.append(entry)
        self._append([json.dumps(entry, sort_keys=True)])

    def history(self) -> list[dict[str, Any]]:
        """The engine's ops and the applied faults, in order of start."""
        return sorted([*self.engine.history(), *self.fault_log], key=lambda e: float(e["start"]))

    def kill(self, reason: str) -> NoReturn:
        """Kill the engine and the server as a fatal misuse does (an injected ``die``)."""
        self.engine._die(reason)
        self.die()

    def _append(self, lines: list[str]) -> None:
        if self.history_path is None or not lines:
            return
        with self.history_path.open("a", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in lines))
            fh.flush()

    # The file is appended as ops complete, flushed per line, so it survives os._exit.
    def sync_history(self) -> None:
        if self.history_path is None:
            return
        new = [e for e in self.engine.history() if (e["op"], e["start"]) not in self._written]
        lines = []
        for entry in sorted(new, key=lambda e: e["end"]):
            self._written.add((entry["op"], entry["start"]))
            lines.append(json.dumps(entry, default=repr, sort_keys=True))
        if self.engine.dead and not self._death_written:
            self._death_written = True
            now = time.monotonic()
            lines.append(
                json.dumps(
                    {
                        "op": "server_died",
                        "engine": self.engine.label,
                        "tags": None,
                        "mode": None,
                        "start": now,
                        "end": now,
                        "outcome": "fatal",
                        "detail": self.engine.death_reason,
                    },
                    sort_keys=True,
                )
            )
        self._append(lines)

    def die(self) -> NoReturn:
        """The engine is dead: end the process (``on_death``) so no response goes out."""
        self.sync_history()
        if self.on_death is not None and not self._dying:
            self._dying = True
            self.on_death()
        raise StandInDied(f"engine {self.engine.label} died: {self.engine.death_reason}")

    async def call(self, awaitable: Awaitable[T]) -> T:
        """Await an engine call; a death during it drops the connection instead of answering."""
        try:
            result = await awaitable
        except EngineDead:
            self.die()
        finally:
            if not self.engine.dead:
                self.sync_history()
        if self.engine.dead:
            self.die()
        return result

    async def watch(self) -> None:
        # A death with no request attached (e.g. a dummy batch on released memory) still ends it.
        with contextlib.suppress(StandInDied):
            while not self.engine.dead:  # noqa: ASYNC110 - the engine exposes no death event
                await asyncio.sleep(_DEATH_POLL_S)
            self.die()


def _error(message: str, status: int = 400) -> Response:
    from http import HTTPStatus

    from starlette.responses import JSONResponse

    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = str(status)
    body = {"object": "error", "message": message, "type": phrase, "param": None, "code": status}
    return JSONResponse(body, status_code=status)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(
    engine: SimulatedEngine,
    *,
    api_key: str | Secret | None = None,
    admin_key: str | Secret | None = None,
    on_death: Callable[[], None] | None = None,
    history_file: str | None = None,
    model_path: str = DEFAULT_MODEL_PATH,
) -> FastAPI:
    """The stand-in's ASGI app: SGLang 0.5.23's lifecycle routes in front of ``engine``.

    When the engine dies the app calls ``on_death`` before any response to the killing request
    is sent; ``serve`` passes one that exits the process, which drops every connection and
    closes the port as a crashed SGLang does. Without ``on_death`` (in-process use) requests
    raise ``StandInDied`` instead, which an ASGI server answers with a 500.

    Stand-in only: ``/_standin/faults`` injects HTTP faults into later requests (see
    ``FAULT_KINDS``); each applied fault is logged in the history as op ``"fault"``.
    """
    try:
        from fastapi import FastAPI
        from starlette.responses import JSONResponse, PlainTextResponse, Response
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the stand-in SGLang server needs fastapi and uvicorn: "
            "pip install 'rollout-lifecycle[standin]'"
        ) from exc

    api = as_secret(api_key, what="api_key")
    admin = as_secret(admin_key, what="admin_key")
    if not isinstance(engine, SimulatedEngine):
        raise InvalidArgument(f"engine must be a SimulatedEngine, got {engine!r}")
    history_file = _check_path("history_file", history_file)
    if not isinstance(model_path, str) or not model_path:
        raise InvalidArgument(f"model_path must be a non-empty string, got {model_path!r}")
    if on_death is not None and not callable(on_death):
        raise InvalidArgument(f"on_death must be callable or None, got {on_death!r}")
    state = _StandIn(engine, on_death=on_death, history_file=history_file, model_path=model_path)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        watcher = asyncio.create_task(state.watch(), name=f"standin-watch-{engine.label}")
        try:
            yield
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.standin = state
    # The last added runs first: a request passes auth before it can meet an injected fault.
    app.add_middleware(_FaultMiddleware, state=state)
    app.add_middleware(_AuthMiddleware, api_key=api, admin_key=admin)

    def route(path: str, methods: Iterable[str]) -> Callable[[_Handler], _Handler]:
        def register(handler: _Handler) -> _Handler:
            async def endpoint(request: Request) -> Response:
                if engine.dead:
                    state.die()
                try:
                    return await handler(request)
                except _BadRequest as exc:
                    return _error(exc.message)
                except EngineRejected as exc:
                    return _error(exc.message, exc.status)

            app.add_route(path, endpoint, methods=list(methods))
            if not path.startswith("/_standin/"):
                state.routes.add(path)
            return handler

        return register

    def ok_status(message: str) -> Response:
        return JSONResponse({"message": message, "status": "ok"})

    def success(ok: bool, message: str, **extra: Any) -> Response:
        return JSONResponse(
            {"success": ok, "message": message, **extra}, status_code=200 if ok else 400
        )

    # ------------------------------------------------------------------ lifecycle

    @route("/pause_generation", ["POST"])
    async def pause_generation(request: Request) -> Response:
        body = await _json_body(request)
        mode = _choice(body, "mode", _PAUSE_MODES, "abort")
        await state.call(engine.pause_generation(mode))
        return ok_status("Generation paused successfully.")

    @route("/continue_generation", ["POST"])
    async def continue_generation(request: Request) -> Response:
        body = await _json_body(request)
        _bool(body, "torch_empty_cache", True)
        await state.call(engine.continue_generation())
        return ok_status("Generation continued successfully.")

    @route("/flush_cache", ["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        raw = request.query_params.get("timeout")
        try:
            timeout = 0.0 if raw is None else float(raw)
        except ValueError:
            raise _BadRequest(
                "1 validation error: [{'type': 'float_parsing', 'loc': ('query', 'timeout'), "
                f"'msg': 'Input should be a valid number', 'input': {raw!r}}}]"
            ) from None
        if timeout < 0:
            raise _BadRequest(
                "1 validation error: [{'type': 'greater_than_equal', 'loc': ('query', 'timeout'), "
                f"'msg': 'Input should be greater than or equal to 0', 'input': {raw!r}}}]"
            )
        # sglang: http_server.py flush_cache (plain text; the failure text is the scheduler's
        # message, or "Flush cache failed.\n" when it gave none)
        try:
            await state.call(engine.flush_cache(timeout))
        except EngineRejected as exc:
            text = FLUSH_FAILED if exc.message == FLUSH_FAILED.strip() else exc.message
            return PlainTextResponse(text, status_code=400)
        return PlainTextResponse(_FLUSH_TEXT)

    @route("/release_memory_occupation", ["GET", "POST"])
    async def release_memory_occupation(request: Request) -> Response:
        tags = _tags(await _json_body(request))
        await state.call(engine.release_memory_occupation(tags))
        return JSONResponse(None)

    @route("/resume_memory_occupation", ["GET", "POST"])
    async def resume_memory_occupation(request: Request) -> Response:
        tags = _tags(await _json_body(request))
        await state.call(engine.resume_memory_occupation(tags))
        return JSONResponse(None)

    # ------------------------------------------------------------------ weights

    @route("/begin_weight_update", ["POST"])
    async def begin_weight_update(request: Request) -> Response:
        # sglang: io_struct.py BeginWeightUpdateReqInput (selector defaults to "all")
        selector = _choice(await _json_body(request), "selector", _SELECTORS, "all")
        try:
            await state.call(engine.begin_weight_update(selector))
        except EngineRejected as exc:
            return success(False, exc.message)
        return success(True, "Success")

    @route("/end_weight_update", ["POST"])
    async def end_weight_update(request: Request) -> Response:
        await _json_body(request)
        try:
            await state.call(engine.end_weight_update())
        except EngineRejected as exc:
            return success(False, exc.message)
        return success(True, "Success")

    def update_flags(body: Mapping[str, Any]) -> tuple[str | None, bool, bool]:
        _opt_str(body, "load_format")
        return (
            _opt_str(body, "weight_version"),
            _bool(body, "flush_cache", True),
            _bool(body, "abort_all_requests", False),
        )

    def updated(message: str, version: str | None) -> str:
        return message if version is None else f"{message} Weight version updated to {version}."

    @route("/update_weights_from_disk", ["POST"])
    async def update_weights_from_disk(request: Request) -> Response:
        body = await _json_body(request)
        model_path = _req_str(body, "model_path")
        version, flush, abort_all = update_flags(body)
        try:
            await state.call(
                engine.update_weights_from_disk(
                    model_path,
                    weight_version=version,
                    flush_cache=flush,
                    abort_all_requests=abort_all,
                )
            )
        except EngineRejected as exc:
            if exc.message == WEIGHTS_WRITTEN_FLUSH_FAILED:
                state.model_path = model_path
            return success(False, exc.message, num_paused_requests=0)
        state.model_path = model_path
        message = updated("Succeeded to update model weights.", version)
        return success(True, message, num_paused_requests=0)

    # sglang: io_struct.py UpdateWeightsFromTensorReqInput / UpdateWeightsFromDistributedReqInput
    # (selector defaults to "all"; the call uses its own selector, whatever begin was given)

    @route("/update_weights_from_tensor", ["POST"])
    async def update_weights_from_tensor(request: Request) -> Response:
        body = await _json_body(request)
        payload = _req_list(body, "serialized_named_tensors")
        selector = _choice(body, "selector", _SELECTORS, "all")
        _bool(body, "torch_empty_cache", False)
        version, flush, abort_all = update_flags(body)
        try:
            await state.call(
                engine.update_weights_from_tensor(
                    payload,
                    weight_version=version,
                    flush_cache=flush,
                    abort_all_requests=abort_all,
                    selector=selector,
                )
            )
        except EngineRejected as exc:
            return success(False, exc.message)
        # sglang: weight_updater.py update_weights_from_tensor answers "Success"
        return success(True, updated("Success", version))

    @route("/update_weights_from_distributed", ["POST"])
    async def update_weights_from_distributed(request: Request) -> Response:
        body = await _json_body(request)
        names, dtypes, shapes = (_req_list(body, k) for k in ("names", "dtypes", "shapes"))
        group_name = _opt_str(body, "group_name")
        selector = _choice(body, "selector", _SELECTORS, "all")
        _bool(body, "torch_empty_cache", False)
        load_format = _opt_str(body, "load_format")
        version, flush, abort_all = update_flags(body)
        try:
            await state.call(
                engine.update_weights_from_distributed(
                    names,
                    dtypes,
                    shapes,
                    DEFAULT_GROUP_NAME if group_name is None else group_name,
                    weight_version=version,
                    flush_cache=flush,
                    abort_all_requests=abort_all,
                    load_format=load_format,
                    selector=selector,
                )
            )
        except EngineRejected as exc:
            return success(False, exc.message)
        return success(True, updated("Succeeded to update parameter online.", version))

    @route("/init_weights_update_group", ["POST"])
    async def init_weights_update_group(request: Request) -> Response:
        # sglang: io_struct.py InitWeightsUpdateGroupReqInput; the stand-in records the group
        # and forms no collective.
        body = await _json_body(request)
        address = _req_str(body, "master_address")
        port, offset, world = (
            _req_int(body, k) for k in ("master_port", "rank_offset", "world_size")
        )
        group_name = _opt_str(body, "group_name")
        backend = _opt_str(body, "backend")
        try:
            await state.call(
                engine.init_weights_update_group(
                    address,
                    port,
                    offset,
                    world,
                    group_name=DEFAULT_GROUP_NAME if group_name is None else group_name,
                    backend="nccl" if backend is None else backend,
                )
            )
        except EngineRejected as exc:
            return success(False, exc.message)
        return success(True, "Succeeded to initialize custom process group.")

    @route("/destroy_weights_update_group", ["POST"])
    async def destroy_weights_update_group(request: Request) -> Response:
        # sglang: io_struct.py DestroyWeightsUpdateGroupReqInput
        group_name = _opt_str(await _json_body(request), "group_name")
        try:
            await state.call(
                engine.destroy_weights_update_group(
                    DEFAULT_GROUP_NAME if group_name is None else group_name
                )
            )
        except EngineRejected as exc:
            return success(False, exc.message)
        return success(True, "Succeeded to destroy custom process group.")

    @route("/update_weight_version", ["POST"])
    async def update_weight_version(request: Request) -> Response:
        body = await _json_body(request)
        version = _req_str(body, "new_version")
        # SGLang's default aborts every request, including those a retract pause preserved.
        abort_all = _bool(body, "abort_all_requests", True)
        await state.call(engine.update_weight_version(version, abort_all_requests=abort_all))
        return JSONResponse(
            {
                "success": True,
                "message": f"Weight version updated to {version}",
                "new_version": version,
            }
        )

    @route("/abort_request", ["POST"])
    async def abort_request(request: Request) -> Response:
        body = await _json_body(request)
        rid = _opt_str(body, "rid") or ""
        abort_all = _bool(body, "abort_all", False)
        await state.call(engine.abort_request(rid, abort_all=abort_all))
        return Response(status_code=200)

    # ------------------------------------------------------------------ probes and info

    async def health(_: Request) -> Response:
        # A real one-token generation: while paused it hangs, then answers 503.
        try:
            await state.call(engine.health())
        except EngineRejected:
            return Response(status_code=503)
        return Response(status_code=200)

    route("/health", ["GET"])(health)
    route("/health_generate", ["GET"])(health)

    @route("/ready", ["GET"])
    async def ready(_: Request) -> Response:
        # sglang: http_server.py ready (tokenizer_manager.is_ready: not paused and Up)
        return Response(status_code=200 if await state.call(engine.ready()) else 503)

    @route("/ping", ["GET"])
    async def ping(_: Request) -> Response:
        # sglang: http_server.py sagemaker_health (is_healthy(): Up, paused or not; a normal
        # endpoint for auth)
        return Response(status_code=200 if await state.call(engine.ping()) else 503)

    async def server_info(_: Request) -> Response:
        # sglang: http_server.py server_info, utils/common.py build_server_info: the resolved
        # server arguments, keys in clear (the client must mask them, not the server).
        info = await state.call(engine.server_info())
        keys = {
            "api_key": None if api is None else api.reveal(),
            "admin_api_key": None if admin is None else admin.reveal(),
        }
        info.update(model_path=state.initial_model_path, tokenizer_path=state.initial_model_path)
        info.update(keys)
        for rank in info["internal_states"]:
            rank.update(model_path=state.initial_model_path, **keys)
        return JSONResponse(info)

    route("/server_info", ["GET"])(server_info)
    route("/get_server_info", ["GET"])(server_info)

    async def model_info(_: Request) -> Response:
        # sglang: http_server.py model_info (the model a weight update swapped in, the
        # tokenizer's weight version); it answers before warm-up.
        version = await state.call(engine.weight_version())
        return JSONResponse(
            {
                "model_path": state.model_path,
                "served_model_name": state.initial_model_path,
                "tokenizer_path": state.initial_model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": version,
            }
        )

    route("/model_info", ["GET"])(model_info)
    route("/get_model_info", ["GET"])(model_info)

    @route("/generate", ["POST", "PUT"])
    async def generate(request: Request) -> Response:
        body = await _json_body(request)
        task = asyncio.ensure_future(engine.generate(body))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            gone.cancel()
        if not task.done():
            # SGLang aborts a request whose client went away; nobody reads this answer.
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, EngineDead):
                await task
            return Response(status_code=499)
        try:
            result = await state.call(task)
        except EngineRejected as exc:
            return JSONResponse({"error": {"message": exc.message}}, status_code=exc.status)
        return JSONResponse(result)

    # ------------------------------------------------------------------ stand-in only

    @route("/_standin/history", ["GET"])
    async def standin_history(_: Request) -> Response:
        return JSONResponse(json.loads(json.dumps(state.history(), default=repr)))

    @route("/_standin/memory", ["GET"])
    async def standin_memory(_: Request) -> Response:
        return JSONResponse(engine.memory())

    @route("/_standin/state", ["GET"])
    async def standin_state(_: Request) -> Response:
        return JSONResponse(engine.state())

    @route("/_standin/stats", ["GET"])
    async def standin_stats(_: Request) -> Response:
        return JSONResponse(engine.stats())

    @route(FAULTS_PATH, ["GET", "POST", "DELETE"])
    async def standin_faults(request: Request) -> Response:
        # POST adds rules (all or none), DELETE clears them; each answers the rules in force.
        if request.method == "POST":
            raw = await request.body()
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise _BadRequest(f"JSON decode error: {exc}") from None
            state.faults.extend(_parse_fault_rules(body, state.routes))
        elif request.method == "DELETE":
            state.faults.clear()
        return JSONResponse({"faults": [rule.to_json() for rule in state.faults]})

    return app


# --------------------------------------------------------------------------------- serve


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    *,
    host: str = "127.0.0.1",
    port: int,
    api_key: str | Secret | None = None,
    admin_key: str | Secret | None = None,
    engine_options: Mapping[str, Any] | None = None,
    history_file: str | None = None,
    model_path: str = DEFAULT_MODEL_PATH,
    print_ready: bool = True,
    allow_remote: bool = False,
) -> int:
    """Run a stand-in server in this process until it is stopped or its engine dies.

    ``port=0`` lets the OS pick one. Once connections are accepted it prints
    ``FAKE_SGLANG_READY port=<N>`` on stdout. When the engine dies the process exits at once
    with status ``DEATH_EXIT_CODE``: in-flight connections drop and the port closes, as with
    SGLang. Only loopback hosts are allowed unless ``allow_remote``.
    """
    try:
        import uvicorn
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the stand-in SGLang server needs fastapi and uvicorn: "
            "pip install 'rollout-lifecycle[standin]'"
        ) from exc
    if not isinstance(host, str) or not host:
        raise InvalidArgument(f"host must be a non-empty string, got {host!r}")
    check_flag("print_ready", print_ready)
    check_flag("allow_remote", allow_remote)
    if engine_options is not None and not isinstance(engine_options, Mapping):
        raise InvalidArgument(f"engine_options must be a mapping or None, got {engine_options!r}")
    if not allow_remote and not _is_loopback(host):
        raise InvalidArgument(
            f"host {host!r} is not a loopback address; the stand-in has no TLS and serves "
            "control endpoints, so pass allow_remote=True (--allow-remote) to expose it"
        )
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgument(f"port must be an int in 0..65535, got {port!r}")
    engine = SimulatedEngine(**check_engine_options(engine_options or {}))

    def on_death() -> None:
        sys.stderr.write(
            f"fake-sglang: engine {engine.label} died: {engine.death_reason}; "
            f"exiting with status {DEATH_EXIT_CODE} like a crashed SGLang server\n"
        )
        sys.stderr.flush()
        os._exit(DEATH_EXIT_CODE)

    app = create_app(
        engine,
        api_key=api_key,
        admin_key=admin_key,
        on_death=on_death,
        history_file=history_file,
        model_path=model_path,
    )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    bound_port: int = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=2,
    )
    # An injected drop raises on purpose once its response has started; it is no app error.
    uvicorn_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _QuietDrops) for f in uvicorn_log.filters):
        uvicorn_log.addFilter(_QuietDrops())
    server = uvicorn.Server(config)

    async def main() -> bool:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():  # noqa: ASYNC110 - uvicorn has no event
            await asyncio.sleep(0.01)
        if server.started and print_ready:
            sys.stdout.write(f"{READY_PREFIX} port={bound_port}\n")
            sys.stdout.flush()
        await task
        started = bool(server.started)
        await engine.close()
        return started

    try:
        started = asyncio.run(main())
    finally:
        sock.close()
    return 0 if started else 1


# --------------------------------------------------------------------------------- subprocess


def _latency_arg(op: str, value: object) -> str:
    if isinstance(value, tuple):
        return f"{op}={float(value[0])!r},{float(value[1])!r}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{op}={float(value)!r}"
    raise InvalidArgument(f"op_latency[{op!r}] must be seconds or a (low, high) pair")


def _engine_argv(options: Mapping[str, Any]) -> list[str]:
    """The ``fake-sglang`` flags that rebuild ``SimulatedEngine(**options)`` in the child."""
    argv: list[str] = []
    scalar_flags = {
        "label": "--label",
        "token_latency": "--token-latency",
        "seed": "--seed",
        "health_timeout": "--health-timeout",
        "weight_version": "--weight-version",
        "max_running": "--max-running",
        "gpu_memory_bytes": "--gpu-memory-bytes",
    }
    for name, value in options.items():
        if value is None:
            continue
        if name in scalar_flags:
            text = repr(float(value)) if isinstance(value, float) else str(value)
            argv += [scalar_flags[name], text]
        elif name == "op_latency":
            pairs = [_latency_arg(op, v) for op, v in dict(value).items()]
            if pairs:
                argv += ["--op-latency", *pairs]
        elif name == "memory_bytes":
            pairs = [f"{getattr(t, 'value', t)}={int(n)}" for t, n in dict(value).items()]
            if pairs:
                argv += ["--memory-bytes", *pairs]
        elif name in ("weights_cpu_backup", "dp_dummy_batches", "check_model_paths"):
            if value:
                argv.append("--" + name.replace("_", "-"))
        else:
            raise InvalidArgument(f"unknown engine option {name!r} for a stand-in server")
    return argv


def _check_path(what: str, value: object) -> str | None:
    """A file path (a string or ``os.PathLike``) as a string, None for None; else refuse it."""
    if value is None:
        return None
    if not isinstance(value, str | os.PathLike):
        raise InvalidArgument(f"{what} must be a path or None, got {value!r}")
    path = os.fspath(value)
    if not isinstance(path, str) or not path:
        raise InvalidArgument(f"{what} must be a non-empty text path or None, got {value!r}")
    return path


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


class StandInServer:
    """A stand-in SGLang server in a subprocess (``rollout-lifecycle fake-sglang``) on loopback.

    Keys reach the child through environment variables, never its command line. Start several
    at once with ``start_many`` / ``start_all`` (each child spends a second or two importing).
    """

    def __init__(
        self,
        *,
        admin_key: str | Secret | None = None,
        api_key: str | Secret | None = None,
        history_file: str | os.PathLike[str] | None = None,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        model_path: str | None = None,
        port: int = 0,
        **engine_options: Any,
    ) -> None:
        self._startup_timeout = check_seconds("startup_timeout", startup_timeout)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise InvalidArgument(f"port must be an int in 0..65535 (0: any free), got {port!r}")
        #: The port asked for: 0 takes a free one; a port a stopped stand-in used restarts a
        #: server at the same URL.
        self._port_asked = port
        self._admin_key = as_secret(admin_key, what="admin_key")
        self._api_key = as_secret(api_key, what="api_key")
        self._history_file = _check_path("history_file", history_file)
        if model_path is not None and (not isinstance(model_path, str) or not model_path):
            raise InvalidArgument(
                f"model_path must be a non-empty string or None, got {model_path!r}"
            )
        self._model_path = model_path
        engine_options.setdefault("label", "fake-sglang")
        # Invalid options fail here, not in the child.
        SimulatedEngine(**check_engine_options(engine_options))
        self._engine_argv = _engine_argv(engine_options)
        self.label: str = engine_options["label"]
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self._ready = threading.Event()
        self._port: int | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def __repr__(self) -> str:
        where = self.url if self._port is not None else "not started"
        return f"StandInServer(label={self.label!r}, {where}, alive={self.alive()})"

    # ------------------------------------------------------------------ starting

    def _argv(self) -> list[str]:
        argv = [sys.executable, "-m", "rollout_lifecycle.cli", "fake-sglang"]
        argv += ["--port", str(self._port_asked)]
        argv += self._engine_argv
        if self._admin_key is not None:
            argv += ["--admin-key-env", ADMIN_KEY_ENV]
        if self._api_key is not None:
            argv += ["--api-key-env", API_KEY_ENV]
        if self._history_file is not None:
            argv += ["--history-file", self._history_file]
        if self._model_path is not None:
            argv += ["--model-path", self._model_path]
        return argv

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in (ADMIN_KEY_ENV, API_KEY_ENV)}
        if self._admin_key is not None:
            env[ADMIN_KEY_ENV] = self._admin_key.reveal()
        if self._api_key is not None:
            env[API_KEY_ENV] = self._api_key.reveal()
        # The child must import this very package, installed or not.
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _spawn(self) -> None:
        if self._proc is not None:
            raise StandInFailed(f"stand-in {self.label} was already started")
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the child
        proc = subprocess.Popen(
            self._argv(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=self._env(),
        )
        self._proc = proc
        self._finalizer = weakref.finalize(self, _kill, proc)
        threading.Thread(
            target=self._read_stdout, args=(proc,), name=f"standin-{self.label}", daemon=True
        ).start()

    def _read_stdout(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:  # drained to EOF so the child never blocks on a full pipe
            line = raw.decode("utf-8", "replace").strip()
            if not self._ready.is_set() and line.startswith(READY_PREFIX + " port="):
                with contextlib.suppress(ValueError):
                    self._port = int(line.rpartition("=")[2])
                    self._ready.set()
        proc.stdout.close()

    def _await_ready(self, deadline: float) -> None:
        proc = self._proc
        if proc is None:
            raise StandInFailed(f"stand-in {self.label} was never started")
        while not self._ready.wait(0.02):
            if proc.poll() is not None:
                # The reader may still be on the last line; give it a moment.
                if self._ready.wait(_EXIT_READ_GRACE_S):
                    break
                raise StandInFailed(
                    f"stand-in {self.label} exited with status {proc.returncode} before it was "
                    f"ready; stderr: {self.stderr_text()[-2000:]}"
                )
            if time.monotonic() > deadline:
                self.stop(2.0)
                raise StandInFailed(
                    f"stand-in {self.label} not ready within {self._startup_timeout:g}s; "
                    f"stderr: {self.stderr_text()[-2000:]}"
                )

    def start(self) -> StandInServer:
        """Spawn the server and wait (at most ``startup_timeout``) until it accepts requests."""
        self._spawn()
        self._await_ready(time.monotonic() + self._startup_timeout)
        return self

    @classmethod
    def start_all(cls, servers: Iterable[StandInServer]) -> list[StandInServer]:
        """Spawn every server first, then wait for all; on any failure stop them all."""
        started = list(servers)
        try:
            for server in started:
                server._spawn()
            now = time.monotonic()
            for server in started:
                server._await_ready(now + server._startup_timeout)
        except BaseException:
            for server in started:
                server.stop(2.0)
            raise
        return started

    @classmethod
    def start_many(cls, n: int, **options: Any) -> list[StandInServer]:
        """Start ``n`` alike servers at once; with a ``label``, server ``i`` is ``label-i``."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"n must be a positive int, got {n!r}")
        label = options.pop("label", "fake-sglang")
        return cls.start_all(cls(label=f"{label}-{i}", **options) for i in range(n))

    @classmethod
    @contextlib.contextmanager
    def running(cls, n: int, **options: Any) -> Iterator[list[StandInServer]]:
        """``start_many`` as a context manager: the servers are stopped when it exits (a
        module fixture is ``with StandInServer.running(3) as servers: yield servers``)."""
        servers = cls.start_many(n, **options)
        try:
            yield servers
        finally:
            for server in servers:
                server.stop()

    @classmethod
    async def start_many_async(cls, n: int, **options: Any) -> list[StandInServer]:
        """``start_many`` without blocking the event loop."""
        return await asyncio.to_thread(cls.start_many, n, **options)

    # ------------------------------------------------------------------ inspecting

    @property
    def port(self) -> int:
        """The port the server listens on (known once it is ready)."""
        if self._port is None:
            raise StandInFailed(f"stand-in {self.label} is not started")
        return self._port

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The server process's id."""
        if self._proc is None:
            raise StandInFailed(f"stand-in {self.label} is not started")
        return self._proc.pid

    @property
    def history_file(self) -> str | None:
        """Where the server appends its ops as JSON lines, if anywhere."""
        return self._history_file

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has ended (``DEATH_EXIT_CODE`` after a death)."""
        return None if self._proc is None else self._proc.poll()

    def alive(self) -> bool:
        """True while the server process runs."""
        return self._proc is not None and self._proc.poll() is None

    def stderr_text(self) -> str:
        """What the server wrote on stderr so far (why it died, for instance)."""
        if self._stderr is None or self._stderr.closed:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", "replace")

    # ------------------------------------------------------------------ stand-in routes

    def _standin_call(self, method: str, path: str, body: object = None) -> Any:
        """One request to a ``/_standin/`` route, with the key its auth level wants."""
        import httpx

        # /_standin/* routes are at SGLang's normal level: the api key, when there is one.
        key = self._api_key
        headers = {"Authorization": f"Bearer {key.reveal()}"} if key is not None else {}
        try:
            with httpx.Client(base_url=self.url, timeout=10.0, trust_env=False) as client:
                if body is None:
                    answer = client.request(method, path, headers=headers)
                else:
                    answer = client.request(method, path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise StandInFailed(
                f"stand-in {self.label}: {method} {path} failed ({type(exc).__name__}: {exc})"
            ) from None
        if answer.status_code == 400:
            try:
                message = answer.json()["message"]
            except (ValueError, KeyError, TypeError):
                message = answer.text
            raise InvalidArgument(f"stand-in {self.label} refused {method} {path}: {message}")
        if not answer.is_success:
            raise StandInFailed(
                f"stand-in {self.label}: {method} {path} answered {answer.status_code}: "
                f"{answer.text[:500]}"
            )
        return answer.json()

    def inject(self, *rules: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Add fault rules (``POST /_standin/faults``); returns the rules now in force.

        A rule is ``{"path": "/pause_generation", "kind": K, "count": N, ...}``: ``kind`` one of
        ``FAULT_KINDS``, ``count`` the requests it hits (default 1, -1 forever), ``seconds`` for
        a delay, ``status`` (400..599, default 502) for a status. A bad rule raises
        ``InvalidArgument`` and none is added.
        """
        for rule in rules:
            if not isinstance(rule, Mapping):
                raise InvalidArgument(f"a fault rule must be a mapping, got {rule!r}")
        answer = self._standin_call("POST", FAULTS_PATH, [dict(rule) for rule in rules])
        result: list[dict[str, Any]] = answer["faults"]
        return result

    def clear_faults(self) -> None:
        """Remove every fault rule (``DELETE /_standin/faults``)."""
        self._standin_call("DELETE", FAULTS_PATH)

    def faults(self) -> list[dict[str, Any]]:
        """The fault rules in force, with the requests each will still hit and has hit."""
        result: list[dict[str, Any]] = self._standin_call("GET", FAULTS_PATH)["faults"]
        return result

    def state(self) -> dict[str, Any]:
        """What SGLang does not publish: paused, pause mode, released tags, weights valid,
        a deferred flush, an open weight-update session (``GET /_standin/state``)."""
        result: dict[str, Any] = self._standin_call("GET", "/_standin/state")
        return result

    def history(self) -> list[dict[str, Any]]:
        """The engine's ops and the injected faults so far (``GET /_standin/history``)."""
        result: list[dict[str, Any]] = self._standin_call("GET", "/_standin/history")
        return result

    # ------------------------------------------------------------------ ending

    def wait_dead(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the process to end; True if it has."""
        timeout = check_seconds("timeout", timeout, positive=False)
        if self._proc is None:
            return True
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self, timeout: float = 5.0) -> int | None:
        """Terminate the server (kill it if it lingers past ``timeout``); its exit status."""
        timeout = check_seconds("timeout", timeout, positive=False)
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _kill(proc)
        return proc.returncode

    def restart(self, timeout: float = 5.0) -> StandInServer:
        """Stop the server and start a new one at the same URL, as an orchestrator restarts a
        server in place: what answers there then is a fresh server with a new incarnation (every
        tag resident, not paused, the initial weights), and whatever was in flight is lost."""
        port = self.port
        self.stop(timeout)
        if self._stderr is not None:
            self._stderr.close()
        self._port_asked, self._port = port, None
        self._proc, self._ready = None, threading.Event()
        return self.start()

    def __enter__(self) -> StandInServer:
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        if self._stderr is not None:
            self._stderr.close()


__all__ = [
    "ADMIN_KEY_ENV",
    "API_KEY_ENV",
    "CONTROL_PATHS",
    "DEATH_EXIT_CODE",
    "DEFAULT_STARTUP_TIMEOUT",
    "FAULTS_PATH",
    "FAULT_KINDS",
    "OPEN_PREFIXES",
    "READY_PREFIX",
    "StandInDied",
    "StandInFailed",
    "StandInServer",
    "auth_level",
    "create_app",
    "request_allowed",
    "serve",
]
