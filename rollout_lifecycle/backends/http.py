"""The production ``EngineBackend``: an async HTTP client of one SGLang 0.5.23 server.

Explicit bodies, a key per endpoint, retries only where repeating is harmless, one error boundary.
This module has the engine, its lifecycle and generate calls, and URLs; the weight calls and
probes are its base class (``http_calls``), the sending and error translation its transport
(``http_transport``), timeouts and value checks ``http_wire``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import httpx

from rollout_lifecycle.backends.http_calls import MIN_SGLANG_VERSION, SGLangCalls
from rollout_lifecycle.backends.http_transport import HTTPTransport, scrub
from rollout_lifecycle.backends.http_wire import (
    HTTPTimeouts,
    parse_version,
    shown,
)
from rollout_lifecycle.backends.secret import Secret, as_secret
from rollout_lifecycle.contract.exceptions import InvalidArgument
from rollout_lifecycle.contract.urls import validate_url
from rollout_lifecycle.contract.values import (
    PauseMode,
    Tag,
    check_flag,
    check_int,
    check_seconds,
    parse_tags,
)

__all__ = [
    "MIN_SGLANG_VERSION",
    "WEIGHT_SELECTORS",
    "HTTPTimeouts",
    "SGLangHTTPEngine",
    "check_seconds",
    "parse_version",
    "scrub",
    "sglang_http_factory",
]

#: The most retries a call may be given (each waits up to ``_MAX_BACKOFF``).
_MAX_RETRIES = 1000
#: The runners a weight-update session and its updates apply to.
# sglang: io_struct.py BeginWeightUpdateReqInput / UpdateWeightsFromTensorReqInput /
# UpdateWeightsFromDistributedReqInput.selector: Literal["target", "draft", "all"] = "all"
WEIGHT_SELECTORS: tuple[str, ...] = ("target", "draft", "all")


class SGLangHTTPEngine(SGLangCalls):
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

    ``weight_selector`` ("all", SGLang's default, "target" or "draft") is the one selector sent
    to ``/begin_weight_update`` and to every tensor and distributed update: SGLang applies each
    call to the runners its selector names, so a session and its updates must agree.

    Attach check: before the first lifecycle call (pause, continue, flush, release, resume,
    weight calls) the client reads ``version`` from ``/server_info`` once and refuses an SGLang
    older than ``MIN_SGLANG_VERSION`` (0.5.22), or one whose version it cannot read, with
    ``IllegalEngineOp`` naming what it found; nothing else is sent then. ``check_version()``
    runs it on demand; ``check_version=False`` skips it. Probes, ``generate`` and
    ``abort_request`` are never held back by it.
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
        weight_selector: str = "all",
        check_version: bool = True,
    ) -> None:
        self._admin_key = as_secret(admin_key, what="admin_key")
        self._api_key = as_secret(api_key, what="api_key")
        self._url = validate_url(url)
        if timeouts is None:
            timeouts = HTTPTimeouts()
        elif not isinstance(timeouts, HTTPTimeouts):
            raise InvalidArgument(f"timeouts must be an HTTPTimeouts, got {shown(timeouts)}")
        self._timeouts = timeouts
        self._retries = check_int("retries", retries, maximum=_MAX_RETRIES)
        self._retry_backoff = check_seconds("retry_backoff", retry_backoff, positive=False)
        if transport is not None and not isinstance(transport, httpx.AsyncBaseTransport):
            raise InvalidArgument(
                f"transport must be an httpx.AsyncBaseTransport, got {shown(transport)}"
            )
        self._transport = transport
        if label is None:
            label = self._url
        elif not isinstance(label, str) or not label:
            raise InvalidArgument(f"label must be a non-empty string, got {shown(label)}")
        keys = (self._admin_key, self._api_key)
        if scrub(label, keys) != label or scrub(self._url, keys) != self._url:
            raise InvalidArgument("label and url must not contain a key")
        self._label = label
        if not isinstance(weight_selector, str) or weight_selector not in WEIGHT_SELECTORS:
            valid = ", ".join(WEIGHT_SELECTORS)
            raise InvalidArgument(
                f"weight_selector must be one of {valid}, got {weight_selector!r}"
            )
        self._selector = weight_selector
        self._check_version = check_flag("check_version", check_version)
        #: The SGLang version found by the attach check, once it passed.
        self._version: str | None = None
        self._wire = HTTPTransport(
            self._url,
            label,
            admin_key=self._admin_key,
            api_key=self._api_key,
            connect_timeout=timeouts.connect,
            retries=self._retries,
            retry_backoff=self._retry_backoff,
            transport=transport,
        )

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

    @property
    def weight_selector(self) -> str:
        """The selector sent to ``/begin_weight_update`` and every tensor/distributed update."""
        return self._selector

    @property
    def sglang_version(self) -> str | None:
        """The SGLang version the attach check accepted (None before it ran, or when skipped)."""
        return self._version

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
        await self._attach(op)
        await self._call(op, {"mode": mode.value})

    async def continue_generation(self) -> None:
        """``POST /continue_generation {"torch_empty_cache": true}``; retried."""
        op = "continue_generation"
        await self._attach(op)
        await self._call(op, {"torch_empty_cache": True})

    async def flush_cache(self, timeout: float) -> None:
        """``POST /flush_cache`` with no body; a 400 (not idle) raises ``EngineRejected``.

        ``timeout`` 0 sends no ``timeout`` query: SGLang flushes at once if idle, where while
        paused its waiting queue does not count (so it succeeds after a retract pause), else
        answers 400. This is the idle barrier's call (``EngineHost.flush_cache`` retries the 400
        until its own deadline).

        ``timeout`` T > 0 sends ``?timeout=T``: SGLang defers the flush and re-checks idleness
        *counting* the waiting queue, for up to T seconds; retracted requests sit there while
        paused, so after a retract pause this answers 400 "Timed out waiting for idle state."
        after T, every time. Use T > 0 only to wait for an unpaused engine to go idle.

        The client waits T plus ``flush_margin``. Transport failures are retried within the same
        T; a 400 is not.
        """
        # sglang: flush_wrapper.py SchedulerFlushWrapper.handle (timeout_s <= 0: flush now) and
        # check_pending (is_fully_idle() counts the waiting queue); scheduler.py
        # Scheduler.flush_cache (is_fully_idle(ignore_waiting=self._engine_paused)).
        wait = check_seconds("flush timeout", timeout, positive=False)
        await self._attach("flush_cache")
        await self._call("flush_cache", flush_wait=wait)

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
        await self._attach(op)
        await self._call(op, {"tags": names})

    # ----------------------------------------------------------------------------- requests

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """``POST /generate``, run to completion; sent once. Streaming is not supported here."""
        op = "generate"
        if not isinstance(request, dict):
            raise InvalidArgument(f"request must be a dict, got {shown(request)}")
        if request.get("stream"):
            raise InvalidArgument("generate() does not stream; send the request with stream false")
        # An object answer: a batch (a list) is garbage here.
        data: dict[str, Any] = await self._call(op, request)
        return data

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """``POST /abort_request {"rid", "abort_all"}``: abort the request whose id is ``rid``
        exactly, or every request with ``abort_all``.

        With one tokenizer worker (SGLang's default) the rid must equal a live request's id: a
        prefix or an unknown rid aborts nothing, and ``rid=""`` without ``abort_all`` is
        ignored. Sent once; the answer (200, empty) does not say whether anything was aborted.
        """
        # sglang: tokenizer_manager.py TokenizerManager.abort_request (rid_to_state.get(rid);
        # no state and tokenizer_worker_num == 1 -> return)
        if not isinstance(rid, str):
            raise InvalidArgument(f"rid must be a string, got {shown(rid)}")
        body = {"rid": rid, "abort_all": check_flag("abort_all", abort_all)}
        await self._call("abort_request", body)

    async def close(self) -> None:
        """Close the HTTP client; later calls raise ``EngineDead``. Idempotent, never raises."""
        await self._wire.close()


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
