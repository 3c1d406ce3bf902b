"""The production ``EngineBackend``: an async HTTP client of one SGLang 0.5.23 server.

Explicit bodies, a key per endpoint, retries only where repeating is harmless, one error boundary.
"""

from __future__ import annotations

import asyncio
import functools
import math
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, NoReturn
from urllib.parse import urlsplit

import httpx

from rollout_lifecycle._config import PauseMode, Tag, parse_tags
from rollout_lifecycle._events import logger
from rollout_lifecycle._exceptions import (
    EngineDead,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
    InvalidArgument,
)
from rollout_lifecycle._secret import Secret, as_secret

__all__ = ["HTTPTimeouts", "SGLangHTTPEngine", "check_seconds", "scrub", "sglang_http_factory"]

#: Answers worth another attempt on a call that is safe to repeat: the server (or a proxy in
#: front of it) is briefly unable to serve, and did not do the call.
_RETRY_STATUSES = frozenset({502, 503, 504})
#: How much of an error answer's body goes into an exception message.
_BODY_LIMIT = 500
#: How much of a lower layer's error text goes into an exception message.
_CAUSE_LIMIT = 200
#: What a key is replaced with wherever text from outside (answers, errors) is quoted.
_MASK = "********"
#: Endpoints any api-key holder may call; every other endpoint is a control endpoint.
_NORMAL_PATHS = frozenset(
    {"/generate", "/server_info", "/get_server_info", "/model_info", "/get_model_info"}
)
#: The longest pause between two attempts of a retried call.
_MAX_BACKOFF = 5.0


@dataclass(frozen=True)
class HTTPTimeouts:
    """Seconds each kind of SGLang call may take before it raises ``EngineTimeout``.

    ``connect`` bounds opening a connection; the others bound the wait for an answer.
    ``flush_margin`` is added to a flush's own server-side wait (``?timeout=T``), so the client
    never gives up before the server has answered "not idle".
    """

    connect: float = 5.0
    #: pause, continue, begin/end weight update, weight version, abort.
    control: float = 60.0
    #: release and resume (a resume maps gigabytes back; it can take long).
    memory: float = 300.0
    #: weight updates from disk, tensors or a collective group.
    weights: float = 1800.0
    #: ``/server_info`` and ``/model_info``.
    probe: float = 10.0
    #: one ``/generate`` run to completion.
    generate: float = 3600.0
    flush_margin: float = 10.0

    def __post_init__(self) -> None:
        for f in fields(self):
            check_seconds(f"HTTP timeout {f.name!r}", getattr(self, f.name), positive=True)


@dataclass(frozen=True)
class _Failure:
    """One failed attempt, translated, and whether a safe-to-repeat call may try again."""

    error: EngineError
    retryable: bool


def check_seconds(what: str, value: object, *, positive: bool) -> float:
    """``value`` as a finite number of seconds (> 0 if ``positive``, else >= 0), or refuse it."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        bound = "positive" if positive else ">= 0"
        raise InvalidArgument(f"{what} must be a finite number of seconds {bound}, got {value!r}")
    return float(value)


def _mask_userinfo(url: str) -> str:
    """``url`` with anything between ``//`` and ``@`` masked, for error messages."""
    scheme, sep, rest = url.partition("//")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = f"{_MASK}@{authority.rpartition('@')[2]}"
    return f"{scheme}{sep}{authority}{slash}{path}"


def _validate_url(url: object) -> str:
    """The base URL without a trailing slash; refuses anything but ``http(s)://host[:port]/path``."""
    if not isinstance(url, str) or not url.strip():
        raise InvalidArgument(f"url must be a non-empty string, got {url!r}")
    shown = _mask_userinfo(url)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port validates it
    except ValueError as exc:
        raise InvalidArgument(f"url {shown!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidArgument(f"url {shown!r} must start with http:// or https://")
    if "@" in parts.netloc:
        # A credential in the URL would reach logs, labels and reprs; keys go in admin_key/api_key.
        raise InvalidArgument(
            f"url {shown!r} must not carry user info; pass credentials as admin_key or api_key"
        )
    if not parts.hostname:
        raise InvalidArgument(f"url {shown!r} has no host")
    if parts.query or parts.fragment:
        raise InvalidArgument(f"url {shown!r} must not have a query or fragment")
    return url.rstrip("/")


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be True or False, got {value!r}")
    return value


def _check_str(name: str, value: object, *, optional: bool) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        kind = "a string or None" if optional else "a string"
        raise InvalidArgument(f"{name} must be {kind}, got {type(value).__name__}")
    return value


def _check_str_list(name: str, value: object) -> list[str]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidArgument(f"{name} must be a list of strings, got {type(value).__name__}")
    items = list(value)
    if not all(isinstance(item, str) for item in items):
        raise InvalidArgument(f"{name} must hold strings only")
    return items


def _check_shapes(value: object) -> list[list[int]]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidArgument(f"shapes must be a list of lists of ints, got {type(value).__name__}")
    shapes: list[list[int]] = []
    for shape in value:
        if isinstance(shape, str) or not isinstance(shape, Sequence):
            raise InvalidArgument(f"each shape must be a list of ints, got {shape!r}")
        dims = list(shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise InvalidArgument(f"each shape must hold ints >= 0, got {shape!r}")
        shapes.append(dims)
    return shapes


def _seconds_param(value: float) -> str:
    """A duration for a query string: millisecond precision, never exponent notation."""
    return repr(round(float(value), 3))


class SGLangHTTPEngine:
    """One SGLang 0.5.23 server over HTTP; implements ``EngineBackend``.

    Keys are sent as ``Authorization: Bearer``: control calls use the admin key when one is
    given (else the api key); ``/generate``, ``/server_info`` and ``/model_info`` use the api key
    when one is given (else the admin key). Keys never appear in the label, the repr, events or
    exception text.

    Only calls that are harmless to repeat are retried (pause, continue, flush, the probes), on
    connection failures and 502/503/504; release, resume, weight updates and generate are sent
    exactly once, because a repeated release or resume kills the server.

    The ``httpx.AsyncClient`` is created on first use, on the running loop, and ignores proxy
    environment variables (a proxy between trainer and engine would see the keys).
    """

    def __init__(
        self,
        url: str,
        *,
        admin_key: str | Secret | None = None,
        api_key: str | Secret | None = None,
        timeouts: HTTPTimeouts | None = None,
        retries: int = 3,
        retry_backoff: float = 0.2,
        transport: httpx.AsyncBaseTransport | None = None,
        label: str | None = None,
    ) -> None:
        self._admin_key = as_secret(admin_key, what="admin_key")
        self._api_key = as_secret(api_key, what="api_key")
        self._url = _validate_url(url)
        if timeouts is None:
            timeouts = HTTPTimeouts()
        elif not isinstance(timeouts, HTTPTimeouts):
            raise InvalidArgument(
                f"timeouts must be an HTTPTimeouts, got {type(timeouts).__name__}"
            )
        self._timeouts = timeouts
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise InvalidArgument(f"retries must be an int >= 0, got {retries!r}")
        self._retries = retries
        self._retry_backoff = check_seconds("retry_backoff", retry_backoff, positive=False)
        if transport is not None and not isinstance(transport, httpx.AsyncBaseTransport):
            raise InvalidArgument(
                f"transport must be an httpx.AsyncBaseTransport, got {type(transport).__name__}"
            )
        self._transport = transport
        if label is None:
            label = self._url
        elif not isinstance(label, str) or not label:
            raise InvalidArgument("label must be a non-empty string")
        if self._scrub(label) != label or self._scrub(self._url) != self._url:
            raise InvalidArgument("label and url must not contain a key")
        self._label = label
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # ----------------------------------------------------------------------------- properties

    @property
    def label(self) -> str:
        """The engine's name in errors and events (the URL unless given)."""
        return self._label

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self._url

    @property
    def timeouts(self) -> HTTPTimeouts:
        """The timeouts in force."""
        return self._timeouts

    def __repr__(self) -> str:
        return (
            f"SGLangHTTPEngine({self._url!r}, label={self._label!r}, "
            f"admin_key={self._admin_key!r}, api_key={self._api_key!r})"
        )

    # ----------------------------------------------------------------------------- lifecycle

    async def pause_generation(self, mode: PauseMode) -> None:
        """``POST /pause_generation {"mode": ...}``; retried (a repeated pause does no harm)."""
        op = "pause_generation"
        try:
            mode = PauseMode(mode)
        except ValueError:
            valid = ", ".join(m.value for m in PauseMode)
            raise InvalidArgument(f"unknown pause mode {mode!r}; valid: {valid}") from None
        response = await self._request(
            op, "POST", "/pause_generation", {"mode": mode.value}, self._timeouts.control
        )
        self._expect_no_refusal(op, response)

    async def continue_generation(self) -> None:
        """``POST /continue_generation {"torch_empty_cache": true}``; retried."""
        op = "continue_generation"
        response = await self._request(
            op, "POST", "/continue_generation", {"torch_empty_cache": True}, self._timeouts.control
        )
        self._expect_no_refusal(op, response)

    async def flush_cache(self, timeout: float) -> None:
        """``POST /flush_cache?timeout=T`` with no body; a 400 (not idle) raises ``EngineRejected``.

        The server waits up to ``timeout`` seconds for idleness; the client waits that long plus
        ``flush_margin``. Transport failures are retried within the same ``timeout``; a 400 is not
        (``EngineHost.flush_cache`` retries it until its own deadline).
        """
        wait = check_seconds("flush timeout", timeout, positive=False)
        await self._request(
            "flush_cache",
            "POST",
            "/flush_cache",
            None,
            self._timeouts.flush_margin,
            flush_wait=wait,
        )

    async def release_memory_occupation(self, tags: Sequence[Tag]) -> None:
        """``POST /release_memory_occupation {"tags": [...]}``; sent once, never retried."""
        await self._memory_call("release_memory_occupation", tags)

    async def resume_memory_occupation(self, tags: Sequence[Tag]) -> None:
        """``POST /resume_memory_occupation {"tags": [...]}``; sent once, never retried."""
        await self._memory_call("resume_memory_occupation", tags)

    async def _memory_call(self, op: str, tags: Sequence[Tag]) -> None:
        # An empty list means "all three tags" to SGLang: resuming a tag that is not released
        # kills the server, so the tags are always named, and validated before anything is sent.
        names = [t.value for t in parse_tags(tags, what=f"{op} tags")]
        response = await self._request(
            op, "POST", f"/{op}", {"tags": names}, self._timeouts.memory, retry=False
        )
        self._expect_no_refusal(op, response)

    # ----------------------------------------------------------------------------- weights

    async def begin_weight_update(self) -> None:
        """``POST /begin_weight_update {"selector": "target"}``."""
        op = "begin_weight_update"
        response = await self._request(
            op,
            "POST",
            "/begin_weight_update",
            {"selector": "target"},
            self._timeouts.control,
            retry=False,
        )
        self._expect_success(op, response)

    async def end_weight_update(self) -> None:
        """``POST /end_weight_update {}``."""
        op = "end_weight_update"
        response = await self._request(
            op, "POST", "/end_weight_update", {}, self._timeouts.control, retry=False
        )
        self._expect_success(op, response)

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
        load_format: str | None = None,
    ) -> None:
        """``POST /update_weights_from_disk``; every flag is sent explicitly; sent once."""
        op = "update_weights_from_disk"
        if not isinstance(model_path, str) or not model_path:
            raise InvalidArgument(f"model_path must be a non-empty string, got {model_path!r}")
        body = {
            "model_path": model_path,
            "load_format": _check_str("load_format", load_format, optional=True),
            "weight_version": _check_str("weight_version", weight_version, optional=True),
            "flush_cache": _check_flag("flush_cache", flush_cache),
            "abort_all_requests": _check_flag("abort_all_requests", abort_all_requests),
        }
        response = await self._request(
            op, "POST", "/update_weights_from_disk", body, self._timeouts.weights, retry=False
        )
        self._expect_success(op, response)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
        load_format: str | None = None,
    ) -> None:
        """``POST /update_weights_from_tensor`` (one base64 payload per TP rank); sent once."""
        op = "update_weights_from_tensor"
        body = {
            "serialized_named_tensors": _check_str_list(
                "serialized_named_tensors", serialized_named_tensors
            ),
            "load_format": _check_str("load_format", load_format, optional=True),
            "weight_version": _check_str("weight_version", weight_version, optional=True),
            "flush_cache": _check_flag("flush_cache", flush_cache),
            "abort_all_requests": _check_flag("abort_all_requests", abort_all_requests),
        }
        response = await self._request(
            op, "POST", "/update_weights_from_tensor", body, self._timeouts.weights, retry=False
        )
        self._expect_success(op, response)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        *,
        weight_version: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
    ) -> None:
        """``POST /update_weights_from_distributed``; the tensors arrive over ``group_name``."""
        op = "update_weights_from_distributed"
        names = _check_str_list("names", names)
        dtypes = _check_str_list("dtypes", dtypes)
        shape_list = _check_shapes(shapes)
        if not len(names) == len(dtypes) == len(shape_list):
            raise InvalidArgument(
                f"names, dtypes and shapes must have one entry per tensor, got "
                f"{len(names)}, {len(dtypes)} and {len(shape_list)}"
            )
        if not isinstance(group_name, str) or not group_name:
            raise InvalidArgument(f"group_name must be a non-empty string, got {group_name!r}")
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shape_list,
            "group_name": group_name,
            "weight_version": _check_str("weight_version", weight_version, optional=True),
            "flush_cache": _check_flag("flush_cache", flush_cache),
            "abort_all_requests": _check_flag("abort_all_requests", abort_all_requests),
        }
        response = await self._request(
            op,
            "POST",
            "/update_weights_from_distributed",
            body,
            self._timeouts.weights,
            retry=False,
        )
        self._expect_success(op, response)

    async def update_weight_version(self, version: str, *, abort_all_requests: bool) -> None:
        """``POST /update_weight_version``; ``abort_all_requests`` is always sent (server default
        is true, which would abort the requests a retract pause preserved)."""
        op = "update_weight_version"
        body = {
            "new_version": _check_str("version", version, optional=False),
            "abort_all_requests": _check_flag("abort_all_requests", abort_all_requests),
        }
        response = await self._request(
            op, "POST", "/update_weight_version", body, self._timeouts.control, retry=False
        )
        self._expect_no_refusal(op, response)

    # ----------------------------------------------------------------------------- probes

    async def model_info(self) -> dict[str, Any]:
        """``GET /model_info`` (old name ``/get_model_info``); retried."""
        return await self._info("model_info", "/model_info", "/get_model_info")

    async def weight_version(self) -> str | None:
        """The loaded weight version, from ``GET /model_info``."""
        info = await self.model_info()
        version = info.get("weight_version")
        if version is not None and not isinstance(version, str):
            self._garbage("weight_version", "/model_info", "weight_version is not a string")
        return version

    async def server_info(self) -> dict[str, Any]:
        """``GET /server_info`` (old name ``/get_server_info``): the liveness probe.

        Safe while paused, unlike ``/health`` and ``/health_generate``, which run a generation
        and hang on a paused server. Server arguments that are keys come back masked.
        """
        info = await self._info("server_info", "/server_info", "/get_server_info")
        masked = self._mask_keys(info)
        assert isinstance(masked, dict)
        return masked

    async def ready(self, timeout: float | None = None) -> bool:
        """One ``GET /model_info``, not retried: True on 200, False if the server cannot answer
        yet (connection refused or dropped, timed out, 502/503/504). Other answers raise (a 401
        means the key is wrong, which waiting will not mend)."""
        wait = (
            self._timeouts.probe
            if timeout is None
            else max(0.001, min(timeout, self._timeouts.probe))
        )
        try:
            await self._request("ready", "GET", "/model_info", None, wait, retry=False)
        except (EngineDead, EngineUnreachable, EngineTimeout):
            return False
        except EngineRejected as exc:
            if exc.status in _RETRY_STATUSES:
                return False
            raise
        return True

    async def _info(self, op: str, path: str, old_path: str) -> dict[str, Any]:
        """A probe's JSON object, from ``path`` or, on a server that predates it, ``old_path``."""
        try:
            response = await self._request(op, "GET", path, None, self._timeouts.probe)
        except EngineRejected as exc:
            if exc.status != 404:
                raise
            path = old_path
            response = await self._request(op, "GET", path, None, self._timeouts.probe)
        data = self._json(op, path, response)
        if not isinstance(data, dict):
            self._garbage(op, path, f"expected a JSON object, got {type(data).__name__}")
        return data

    # ----------------------------------------------------------------------------- requests

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """``POST /generate``, run to completion; sent once. Streaming is not supported here."""
        op = "generate"
        if not isinstance(request, dict):
            raise InvalidArgument(f"request must be a dict, got {type(request).__name__}")
        if request.get("stream"):
            raise InvalidArgument("generate() does not stream; send the request with stream false")
        response = await self._request(
            op, "POST", "/generate", request, self._timeouts.generate, retry=False
        )
        data = self._json(op, "/generate", response)
        if not isinstance(data, dict):
            self._garbage(
                op, "/generate", f"expected one JSON object (no batches), got {type(data).__name__}"
            )
        return data

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """``POST /abort_request {"rid", "abort_all"}``: abort requests whose id starts with rid."""
        if not isinstance(rid, str):
            raise InvalidArgument(f"rid must be a string, got {type(rid).__name__}")
        body = {"rid": rid, "abort_all": _check_flag("abort_all", abort_all)}
        await self._request(
            "abort_request", "POST", "/abort_request", body, self._timeouts.control, retry=False
        )

    async def close(self) -> None:
        """Close the HTTP client; later calls raise ``EngineDead``. Idempotent, never raises."""
        self._closed = True
        client, loop = self._client, self._client_loop
        self._client = self._client_loop = None
        if client is not None and loop is asyncio.get_running_loop():
            await client.aclose()
        # A client bound to another (finished) loop cannot be closed from this one; it is dropped.

    # ----------------------------------------------------------------------------- machinery

    def _client_for_loop(self, op: str) -> httpx.AsyncClient:
        if self._closed:
            raise EngineDead(self._label, op, "the client is closed")
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            # Connections belong to the loop that opened them; a new loop gets a new client.
            self._client = httpx.AsyncClient(
                base_url=self._url,
                transport=self._transport,
                # No connection cap: control calls must never queue behind long generates
                # (a pause waiting for a connection that a paused generate holds would hang).
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
                follow_redirects=False,
                trust_env=False,
            )
            self._client_loop = loop
        return self._client

    def _key_for(self, control: bool) -> tuple[str, Secret] | None:
        order = (
            (("admin key", self._admin_key), ("api key", self._api_key))
            if control
            else (("api key", self._api_key), ("admin key", self._admin_key))
        )
        for name, key in order:
            if key is not None:
                return name, key
        return None

    def _scrub(self, text: str) -> str:
        return scrub(text, (self._admin_key, self._api_key))

    def _mask_keys(self, value: Any) -> Any:
        """A copy of a JSON value with key-like fields and our keys' values masked."""
        if isinstance(value, dict):
            return {
                k: (
                    _MASK
                    if v and isinstance(k, str) and k.endswith("api_key")
                    else self._mask_keys(v)
                )
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [self._mask_keys(v) for v in value]
        if isinstance(value, str):
            return self._scrub(value)
        return value

    async def _request(
        self,
        op: str,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        read_timeout: float,
        *,
        retry: bool = True,
        flush_wait: float | None = None,
    ) -> httpx.Response:
        """Send one call, retrying a safe-to-repeat one; a 2xx answer or a translated error.

        ``body`` None sends no body (GETs and flush only: SGLang answers a bodiless POST with 400).
        With ``flush_wait`` the query carries ``timeout``: what is left of it on each attempt.
        """
        client = self._client_for_loop(op)
        key = self._key_for(control=path not in _NORMAL_PATHS)
        headers = {"Authorization": f"Bearer {key[1].reveal()}"} if key is not None else {}
        attempts = 1 + self._retries if retry else 1
        first = time.monotonic()
        for attempt in range(1, attempts + 1):
            params: dict[str, str] | None = None
            timeout = read_timeout
            if flush_wait is not None:
                left = max(0.0, flush_wait - (time.monotonic() - first))
                params = {"timeout": _seconds_param(left)}
                timeout = left + read_timeout
            started = time.monotonic()
            response: httpx.Response | None = None
            failure: _Failure | None = None
            try:
                response = await client.request(
                    method,
                    path,
                    json=body,
                    params=params,
                    headers=headers,
                    timeout=httpx.Timeout(timeout, connect=self._timeouts.connect),
                )
            except (httpx.HTTPError, httpx.InvalidURL, OSError) as exc:
                failure = self._translate(exc, op, method, path, attempt)
            if response is not None:
                failure = self._check_status(op, method, path, response, key, repeatable=retry)
            logger().debug(
                "http.request",
                engine=self._label,
                op=op,
                method=method,
                path=path,
                status=None if response is None else response.status_code,
                duration_s=round(time.monotonic() - started, 6),
                attempt=attempt,
                error=None if failure is None else type(failure.error).__name__,
            )
            if failure is None:
                assert response is not None
                return response
            if not (retry and failure.retryable and attempt < attempts):
                raise failure.error
            await asyncio.sleep(min(_MAX_BACKOFF, self._retry_backoff * 2 ** (attempt - 1)))
        raise AssertionError("unreachable")  # pragma: no cover

    def _translate(
        self, exc: BaseException, op: str, method: str, path: str, attempt: int
    ) -> _Failure:
        """The single boundary where httpx's (and the socket layer's) errors become ours.

        Only the class name and a scrubbed, truncated text of the lower error are kept: the
        result is raised outside the ``except`` block, so it carries no reference to the
        request (and its headers).
        """
        where = f"{method} {path} (attempt {attempt})"
        cause = self._scrub(str(exc))[:_CAUSE_LIMIT]
        detail = f"{type(exc).__name__}: {cause}" if cause else type(exc).__name__
        if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
            # The request was never sent; trying again is safe for a repeatable call.
            return _Failure(
                EngineTimeout(self._label, op, f"{where}: could not connect in time ({detail})"),
                retryable=True,
            )
        if isinstance(exc, httpx.TimeoutException):
            return _Failure(
                EngineTimeout(
                    self._label, op, f"{where}: no answer in time; effect unknown ({detail})"
                ),
                retryable=False,
            )
        if isinstance(exc, httpx.ConnectError):
            if _caused_by(exc, socket.gaierror):
                return _Failure(
                    EngineUnreachable(self._label, op, f"{where}: host not found ({detail})"),
                    retryable=True,
                )
            return _Failure(
                EngineDead(self._label, op, f"{where}: connection refused ({detail})"),
                retryable=True,
            )
        if isinstance(exc, httpx.TransportError | OSError):
            # A dropped connection is how a server that dies under a call looks to that call.
            return _Failure(
                EngineUnreachable(
                    self._label, op, f"{where}: connection failed or dropped ({detail})"
                ),
                retryable=True,
            )
        return _Failure(
            EngineError(self._label, op, f"{where}: unusable answer ({detail})"), retryable=False
        )

    def _check_status(
        self,
        op: str,
        method: str,
        path: str,
        response: httpx.Response,
        key: tuple[str, Secret] | None,
        *,
        repeatable: bool,
    ) -> _Failure | None:
        status = response.status_code
        if response.is_success:
            return None
        if status == 401:
            said = (
                f"the server refused the {key[0]} (401 Unauthorized)"
                if key is not None
                else "the server wants a key and none was given (401 Unauthorized)"
            )
            return _Failure(EngineRejected(self._label, op, said, 401), retryable=False)
        message = f"{method} {path} answered {status}: {self._detail(response)}"
        if status in _RETRY_STATUSES and not repeatable:
            # A gateway's 502/504 (or a 503 on the way) does not say the server did not do the
            # call: it may have forwarded it and lost the answer. For a call that must not be
            # repeated (a release twice kills), the effect is unknown, not refused.
            return _Failure(
                EngineUnreachable(self._label, op, f"{message}; effect unknown"), retryable=False
            )
        return _Failure(
            EngineRejected(self._label, op, message, status), retryable=status in _RETRY_STATUSES
        )

    def _detail(self, response: httpx.Response) -> str:
        """What an error answer says: its ``message`` if it is SGLang's JSON, else its text."""
        try:
            text = response.text
        except (UnicodeDecodeError, LookupError):
            text = repr(response.content[:_BODY_LIMIT])
        try:
            data = response.json()
        except ValueError:
            data = None
        if isinstance(data, dict):
            for field in ("message", "detail", "error"):
                if isinstance(data.get(field), str):
                    text = data[field]
                    break
        text = self._scrub(text.strip()) or "(empty body)"
        return text if len(text) <= _BODY_LIMIT else f"{text[:_BODY_LIMIT]}..."

    def _json(self, op: str, path: str, response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError:
            self._garbage(op, path, f"not JSON: {self._detail(response)}")

    def _garbage(self, op: str, path: str, why: str) -> NoReturn:
        raise EngineError(self._label, op, f"garbage answer from {path}: {why}")

    def _expect_success(self, op: str, response: httpx.Response) -> None:
        """An answer that must be ``{"success": bool, "message": str}``; false is a rejection."""
        path = response.request.url.path
        data = self._json(op, path, response)
        if not isinstance(data, dict) or not isinstance(data.get("success"), bool):
            self._garbage(
                op, path, f"expected {{'success': bool, ...}}, got {self._detail(response)}"
            )
        if not data["success"]:
            message = data.get("message")
            text = self._scrub(message)[:_BODY_LIMIT] if isinstance(message, str) else ""
            raise EngineRejected(
                self._label,
                op,
                f"{path} answered success=false: {text or '(no message)'}",
                response.status_code,
            )

    def _expect_no_refusal(self, op: str, response: httpx.Response) -> None:
        """A 2xx whose body the contract gives no use for (``null``, ``{"status": "ok"}``):
        accepted unless it says the call failed. An empty body is accepted; a body that is not
        JSON is garbage (something other than SGLang answered), and the effect is unknown."""
        if not response.content.strip():
            return
        data = self._json(op, response.request.url.path, response)
        if not isinstance(data, dict):
            return
        refused = data.get("success") is False or (
            isinstance(data.get("status"), str) and data["status"].lower() in ("error", "failed")
        )
        if refused:
            path = response.request.url.path
            raise EngineRejected(
                self._label, op, f"{path} answered: {self._detail(response)}", response.status_code
            )


def scrub(text: str, keys: Iterable[Secret | None]) -> str:
    """``text`` with every occurrence of the given keys masked."""
    for key in keys:
        if key is not None:
            text = text.replace(key.reveal(), _MASK)
    return text


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _secret_kwargs(kwargs: dict[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """``kwargs`` with its keys wrapped in ``Secret`` (a partial's repr shows its arguments)."""
    out = dict(kwargs)
    for name in names:
        if name in out:
            out[name] = as_secret(out[name], what=name)
    return out


def sglang_http_factory(url: str, **kwargs: Any) -> Callable[[], SGLangHTTPEngine]:
    """A picklable zero-argument factory of ``SGLangHTTPEngine(url, **kwargs)``, for Ray actors.

    The arguments are checked now (constructing an engine opens nothing), so a mistake surfaces
    in the driver, not in an actor.
    """
    kwargs = _secret_kwargs(kwargs, ("admin_key", "api_key"))
    SGLangHTTPEngine(url, **kwargs)
    return functools.partial(SGLangHTTPEngine, url, **kwargs)
