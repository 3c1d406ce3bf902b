"""The HTTP transport under ``SGLangHTTPEngine``: one connection pool per event loop, keys
per endpoint, retries of what is safe to repeat, and the one boundary where httpx's errors and
SGLang's error answers become the library's exceptions (with every key scrubbed).
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import httpx

from rollout_lifecycle.backends.http.rows import ACKNOWLEDGED, Answer, Auth, Endpoint
from rollout_lifecycle.backends.http.wire import HTTPTimeouts, shown
from rollout_lifecycle.backends.secret import Secret
from rollout_lifecycle.contract.events import logger
from rollout_lifecycle.contract.exceptions import (
    EngineDead,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
    InvalidArgument,
)
from rollout_lifecycle.contract.urls import MASK, validate_url
from rollout_lifecycle.contract.values import check_int, check_seconds

#: Answers worth another attempt on a call that is safe to repeat: the server (or a proxy in
#: front of it) is briefly unable to serve, and did not do the call.
RETRY_STATUSES = frozenset({502, 503, 504})
#: How much of an error answer's body goes into an exception message.
_BODY_LIMIT = 500
#: How much of a lower layer's error text goes into an exception message.
_CAUSE_LIMIT = 200
#: The longest pause between two attempts of a retried call.
_MAX_BACKOFF = 5.0
#: How long an idle connection stays in the pool for reuse by calls that are safe to repeat:
#: well below the server's own keep-alive, so that few of them meet a connection the server is
#: closing (and one that does is tried again). httpx's default (5 s) equals SGLang's.
#:
#: A call sent once (a generate, a release, a resume) never reuses a connection: the server arms
#: its keep-alive timer when it has written an answer, which under load can be seconds before
#: the client reads it, so no expiry on the client's side closes the race. On SGLang's uvloop the
#: timer runs before the socket is read, and a server that stalls past it closes the connection
#: with the call unread: a ReadError, its fate unknown. Seen in CI on a real server (a resume of
#: the KV cache; a resubmitted generate before that); a new connection has no timer.
# uvicorn: protocols/http/httptools_impl.py on_response_complete arms timeout_keep_alive_task,
# connection_made arms nothing; sglang: entrypoints/http_server.py runs uvicorn with
# loop="uvloop"
# sglang: environ.py SGLANG_TIMEOUT_KEEP_ALIVE = EnvInt(5), passed to uvicorn as
# timeout_keep_alive (entrypoints/http_server.py _setup_and_run_http_server)
KEEPALIVE_EXPIRY_S = 2.0
#: Server-argument fields that hold a secret (``/server_info`` publishes them in clear).
# sglang: common.py build_server_info (server_args.resolved_dict()), arg_groups/fields/serving.py
_SECRET_FIELD = re.compile(r"(api_key|password|secret|watermark_key)$")
#: Command-line flags whose value is a secret, as ``launch_command`` quotes them.
_SECRET_FLAG = re.compile(
    r"(--(?:admin-api-key|api-key|ssl-keyfile-password|watermark-key)(?:=|\s+))(\S+)"
)


@dataclass(frozen=True)
class _Failure:
    """One failed attempt, translated; whether a safe-to-repeat call may try again; and whether
    the request is known never to have left the client (any call may then try again)."""

    error: EngineError
    retryable: bool
    unsent: bool = False


def _seconds_param(value: float) -> str:
    """A duration for a query string: millisecond precision, never exponent notation."""
    return repr(round(float(value), 3))


def scrub(text: str, keys: Iterable[Secret | None]) -> str:
    """``text`` with every occurrence of the given keys masked."""
    for key in keys:
        if key is not None:
            text = text.replace(key.reveal(), MASK)
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


class HTTPTransport:
    """Sends one SGLang server's calls: the client, the keys, the retries, the error boundary."""

    def __init__(
        self,
        url: str,
        label: str,
        *,
        admin_key: Secret | None,
        api_key: Secret | None,
        connect_timeout: float,
        retries: int,
        retry_backoff: float,
        transport: httpx.AsyncBaseTransport | None,
        keepalive_expiry: float = KEEPALIVE_EXPIRY_S,
    ) -> None:
        self._url = url
        self._keepalive_expiry = keepalive_expiry
        self._label = label
        self._admin_key = admin_key
        self._api_key = api_key
        self._connect_timeout = connect_timeout
        self._retries = retries
        self._retry_backoff = retry_backoff
        self._transport = transport
        #: Per event loop: the pooled client (calls safe to repeat) and the one that opens a
        #: connection per call (calls sent once).
        self._clients: tuple[httpx.AsyncClient, httpx.AsyncClient] | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self._url

    @property
    def label(self) -> str:
        """The engine's name in errors and events."""
        return self._label

    async def close(self) -> None:
        """Close the HTTP client; later calls raise ``EngineDead``. Idempotent, never raises."""
        self._closed = True
        # A client bound to another (finished) loop cannot be closed from this one; it is dropped.
        await self.drop_connections()

    async def drop_connections(self) -> None:
        """Close the pooled connections (the next call opens new ones): after an answer that
        ends the server's side of a connection without saying so, a reused one fails."""
        clients, loop = self._clients, self._client_loop
        self._clients = self._client_loop = None
        if clients is not None and loop is asyncio.get_running_loop():
            for client in dict.fromkeys(clients):
                await client.aclose()

    def client_for_loop(self, op: str, *, once: bool = False) -> httpx.AsyncClient:
        """The client for a call: pooled for one safe to repeat, a connection of its own for
        one sent ``once`` (see ``KEEPALIVE_EXPIRY_S``)."""
        if self._closed:
            raise EngineDead(self._label, op, "the client is closed")
        loop = asyncio.get_running_loop()
        if self._clients is None or self._client_loop is not loop:
            # Connections belong to the loop that opened them; a new loop gets new clients. A
            # transport given by the caller keeps its own connections: one client serves.
            pooled = self._new_client(keepalive=32)
            own = pooled if self._transport is not None else self._new_client(keepalive=0)
            self._clients = (pooled, own)
            self._client_loop = loop
        return self._clients[1 if once else 0]

    def _new_client(self, keepalive: int) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self._url,
            transport=self._transport,
            # No connection cap: control calls must never queue behind long generates (a
            # pause waiting for a connection that a paused generate holds would hang).
            limits=httpx.Limits(
                max_connections=None,
                max_keepalive_connections=keepalive,
                keepalive_expiry=self._keepalive_expiry,
            ),
            follow_redirects=False,
            trust_env=False,
        )

    def key_for(self, control: bool) -> tuple[str, Secret] | None:
        order = (
            (("admin key", self._admin_key), ("api key", self._api_key))
            if control
            else (("api key", self._api_key), ("admin key", self._admin_key))
        )
        for name, key in order:
            if key is not None:
                return name, key
        return None

    def scrub(self, text: str) -> str:
        return scrub(text, (self._admin_key, self._api_key))

    def mask_keys(self, value: Any) -> Any:
        """A copy of a JSON value with secret fields (``api_key``, ``admin_api_key``, passwords),
        secret flags' values in command lines (``launch_command``) and our keys masked."""
        if isinstance(value, dict):
            return {
                k: (
                    MASK
                    if v and isinstance(k, str) and _SECRET_FIELD.search(k)
                    else self.mask_keys(v)
                )
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [self.mask_keys(v) for v in value]
        if isinstance(value, str):
            return _SECRET_FLAG.sub(lambda m: m.group(1) + MASK, self.scrub(value))
        return value

    async def status(self, row: Endpoint, read_timeout: float) -> int | None:
        """One call to ``row``'s endpoint as ``request`` sends it: the status of whatever
        answers at the URL (an error status too), or None when nothing does."""
        try:
            response = await self.request(row, None, read_timeout)
        except (EngineDead, EngineUnreachable, EngineTimeout):
            return None
        except EngineRejected as exc:
            return exc.status
        return response.status_code

    async def request(
        self,
        row: Endpoint,
        body: dict[str, Any] | None,
        read_timeout: float,
        *,
        op: str | None = None,
        path: str | None = None,
        flush_wait: float | None = None,
        query: Mapping[str, str | list[str]] | None = None,
    ) -> httpx.Response:
        """Send one call to ``row``'s endpoint (``path``: one of its aliases), with the key,
        method and retries its row of the table gives; a 2xx answer or a translated error.

        ``body`` None sends no body (GETs and flush only: SGLang answers a bodiless POST with 400).
        With a ``flush_wait`` > 0 the query carries ``timeout``: what is left of it on each
        attempt; with 0 it carries none. ``query`` adds fields sent in the URL (a list value
        repeats its name, as ``?tags=a&tags=b``).
        """
        op = row.name if op is None else op
        method, path, retry = row.method, row.path if path is None else path, row.repeatable
        memory = row.timeout == "memory"
        wait_field = row.wait_field
        if flush_wait is not None and wait_field is None:
            raise AssertionError(f"{row.path} has no query field for a server-side wait")
        client = self.client_for_loop(op, once=not retry)
        key = None if row.auth is Auth.OPEN else self.key_for(control=row.auth is Auth.CONTROL)
        headers = {"Authorization": f"Bearer {key[1].reveal()}"} if key is not None else {}
        if not retry:
            # The server closes it after answering, so the closed connection's TIME_WAIT is kept
            # on its side, not on one of the client's ports (a connection per generate adds up).
            headers["Connection"] = "close"
        attempts = 1 + self._retries
        first = time.monotonic()
        for attempt in range(1, attempts + 1):
            params: dict[str, str | list[str]] | None = None if query is None else dict(query)
            timeout = read_timeout
            if flush_wait is not None and wait_field is not None:  # (refused above otherwise)
                # (the wait counts from the first attempt, which carries all of it)
                spent = 0.0 if attempt == 1 else time.monotonic() - first
                left = max(0.0, flush_wait - spent)
                if flush_wait > 0:
                    # A deferred flush; with no timeout (0) the query is left out altogether.
                    params = {**(params or {}), wait_field: _seconds_param(left)}
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
                    timeout=httpx.Timeout(timeout, connect=self._connect_timeout),
                )
            except (httpx.HTTPError, httpx.InvalidURL, OSError) as exc:
                failure = self.translate(exc, op, method, path, attempt)
            if response is not None:
                failure = self.check_status(
                    op, method, path, response, key, repeatable=retry, memory=memory
                )
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
            if not ((failure.unsent or (retry and failure.retryable)) and attempt < attempts):
                raise failure.error
            await asyncio.sleep(min(_MAX_BACKOFF, self._retry_backoff * 2 ** (attempt - 1)))
        raise AssertionError("unreachable")  # pragma: no cover

    def translate(
        self, exc: BaseException, op: str, method: str, path: str, attempt: int
    ) -> _Failure:
        """The single boundary where httpx's (and the socket layer's) errors become ours.

        Only the class name and a scrubbed, truncated text of the lower error are kept: the
        result is raised outside the ``except`` block, so it carries no reference to the
        request (and its headers).
        """
        where = f"{method} {path} (attempt {attempt})"
        cause = self.scrub(str(exc))[:_CAUSE_LIMIT]
        detail = f"{type(exc).__name__}: {cause}" if cause else type(exc).__name__
        if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
            # No connection was made, so the request was never sent: trying again is safe even
            # for a call sent once (seen in CI: a loaded machine stalled one connect to a live
            # server past its bound). A refused connection is not tried again for such a call:
            # its server is gone, and a new process may soon hold the address.
            return _Failure(
                EngineTimeout(self._label, op, f"{where}: could not connect in time ({detail})"),
                retryable=True,
                unsent=True,
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

    def check_status(
        self,
        op: str,
        method: str,
        path: str,
        response: httpx.Response,
        key: tuple[str, Secret] | None,
        *,
        repeatable: bool,
        memory: bool = False,
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
        message = f"{method} {path} answered {status}: {self.detail(response)}"
        if not repeatable and (status in RETRY_STATUSES or (status >= 500 and memory)):
            # A 5xx does not say the server did not do the call: a gateway's 502/504 (or a 503
            # on the way) may have forwarded it and lost the answer, and a release's or
            # resume's 500 is a handler that raised part-way (a process shutting down, a
            # scheduler that failed after it acted). For a call that must not be repeated (a
            # release twice kills), the effect is unknown, not refused. (Elsewhere a 500 is
            # how both engines refuse: SGLang's asserts before a call is dispatched, vLLM's
            # every refusal.)
            return _Failure(
                EngineUnreachable(self._label, op, f"{message}; effect unknown"), retryable=False
            )
        return _Failure(
            EngineRejected(self._label, op, message, status), retryable=status in RETRY_STATUSES
        )

    def detail(self, response: httpx.Response) -> str:
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
        text = self.scrub(text.strip()) or "(empty body)"
        return text if len(text) <= _BODY_LIMIT else f"{text[:_BODY_LIMIT]}..."

    def json(self, op: str, path: str, response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError:
            self.garbage(op, path, f"not JSON: {self.detail(response)}")

    def garbage(self, op: str, path: str, why: str) -> NoReturn:
        raise EngineError(self._label, op, f"garbage answer from {path}: {why}")

    def read_answer(self, op: str, row: Endpoint, response: httpx.Response) -> Any:
        """Check a 2xx answer as ``row``'s shape says to read it: a ``success: false`` or a
        body that says the call failed raises ``EngineRejected``; an answer of the wrong shape is
        garbage. Returns the JSON object of an ``object`` answer, else None."""
        if row.answer is Answer.SUCCESS:
            self.expect_success(op, response)
        elif row.answer in ACKNOWLEDGED:
            self.expect_no_refusal(op, response)
        elif row.answer is Answer.OBJECT:
            path = response.request.url.path
            data = self.json(op, path, response)
            if not isinstance(data, dict):
                self.garbage(op, path, f"expected a JSON object, got {type(data).__name__}")
            return data
        return None

    def expect_success(self, op: str, response: httpx.Response) -> None:
        """An answer that must be ``{"success": bool, "message": str}``; false is a rejection."""
        path = response.request.url.path
        data = self.json(op, path, response)
        if not isinstance(data, dict) or not isinstance(data.get("success"), bool):
            self.garbage(
                op, path, f"expected {{'success': bool, ...}}, got {self.detail(response)}"
            )
        if not data["success"]:
            message = data.get("message")
            text = self.scrub(message)[:_BODY_LIMIT] if isinstance(message, str) else ""
            raise EngineRejected(
                self._label,
                op,
                f"{path} answered success=false: {text or '(no message)'}",
                response.status_code,
            )

    def expect_no_refusal(self, op: str, response: httpx.Response) -> None:
        """A 2xx whose body the contract gives no use for (``null``, ``{"status": "ok"}``):
        accepted unless it says the call failed. An empty body is accepted; a body that is not
        JSON is garbage (something other than SGLang answered), and the effect is unknown."""
        if not response.content.strip():
            return
        data = self.json(op, response.request.url.path, response)
        if not isinstance(data, dict):
            return
        refused = data.get("success") is False or (
            isinstance(data.get("status"), str) and data["status"].lower() in ("error", "failed")
        )
        if refused:
            path = response.request.url.path
            raise EngineRejected(
                self._label, op, f"{path} answered: {self.detail(response)}", response.status_code
            )


#: The most retries a call may be given (each waits up to ``_MAX_BACKOFF``).
_MAX_RETRIES = 1000


def open_wire(
    url: str,
    label: str | None,
    *,
    admin_key: Secret | None,
    api_key: Secret | None,
    timeouts: HTTPTimeouts | None,
    retries: int,
    retry_backoff: float,
    transport: httpx.AsyncBaseTransport | None,
) -> tuple[HTTPTransport, HTTPTimeouts]:
    """The transport of one engine client, from its options checked (each error names the bad
    value; the label defaults to the URL, and neither may contain a key), and the timeouts."""
    url = validate_url(url)
    if timeouts is None:
        timeouts = HTTPTimeouts()
    elif not isinstance(timeouts, HTTPTimeouts):
        raise InvalidArgument(f"timeouts must be an HTTPTimeouts, got {shown(timeouts)}")
    retries = check_int("retries", retries, maximum=_MAX_RETRIES)
    retry_backoff = check_seconds("retry_backoff", retry_backoff, positive=False)
    if transport is not None and not isinstance(transport, httpx.AsyncBaseTransport):
        raise InvalidArgument(
            f"transport must be an httpx.AsyncBaseTransport, got {shown(transport)}"
        )
    if label is None:
        label = url
    elif not isinstance(label, str) or not label:
        raise InvalidArgument(f"label must be a non-empty string, got {shown(label)}")
    keys = (admin_key, api_key)
    if scrub(label, keys) != label or scrub(url, keys) != url:
        raise InvalidArgument("label and url must not contain a key")
    wire = HTTPTransport(
        url,
        label,
        admin_key=admin_key,
        api_key=api_key,
        connect_timeout=timeouts.connect,
        retries=retries,
        retry_backoff=retry_backoff,
        transport=transport,
    )
    return wire, timeouts


__all__ = ["MASK", "RETRY_STATUSES", "HTTPTransport", "open_wire", "scrub"]
