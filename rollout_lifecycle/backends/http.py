"""The production ``EngineBackend``: an async HTTP client of one SGLang 0.5.23 server.

Explicit bodies, a key per endpoint, retries only where repeating is harmless, one error boundary.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import re
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, NoReturn
from urllib.parse import urlsplit

import httpx

from rollout_lifecycle.backends.secret import Secret, as_secret
from rollout_lifecycle.core.config import (
    DEFAULT_GROUP_NAME,
    PauseMode,
    Tag,
    check_flag,
    check_int,
    check_seconds,
    parse_tags,
)
from rollout_lifecycle.core.events import logger
from rollout_lifecycle.core.exceptions import (
    EngineDead,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
    IllegalEngineOp,
    InvalidArgument,
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
    "url_identity",
]

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
#: Endpoints SGLang serves without a key; none is sent to them.
# sglang: auth.py (/health*, /ready*, /metrics* are open)
_OPEN_PREFIXES = ("/health", "/ready", "/metrics")
#: The longest pause between two attempts of a retried call.
_MAX_BACKOFF = 5.0
#: The most retries a call may be given (each waits up to ``_MAX_BACKOFF``).
_MAX_RETRIES = 1000
#: The oldest SGLang this client drives: 0.5.20 has no begin/end weight-update endpoints and its
#: release asserts plain idleness (a retract pause that left requests waiting kills it); 0.5.21
#: dies on a weight update with ``flush_cache: true`` on a busy engine.
MIN_SGLANG_VERSION: tuple[int, int, int] = (0, 5, 22)
#: The runners a weight-update session and its updates apply to.
# sglang: io_struct.py BeginWeightUpdateReqInput / UpdateWeightsFromTensorReqInput /
# UpdateWeightsFromDistributedReqInput.selector: Literal["target", "draft", "all"] = "all"
WEIGHT_SELECTORS: tuple[str, ...] = ("target", "draft", "all")
#: Server-argument fields that hold a secret (``/server_info`` publishes them in clear).
# sglang: common.py build_server_info (server_args.resolved_dict()), arg_groups/fields/serving.py
_SECRET_FIELD = re.compile(r"(api_key|password|secret|watermark_key)$")
#: Command-line flags whose value is a secret, as ``launch_command`` quotes them.
_SECRET_FLAG = re.compile(
    r"(--(?:admin-api-key|api-key|ssl-keyfile-password|watermark-key)(?:=|\s+))(\S+)"
)
_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


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


#: Host names that reach this machine's loopback interface.
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def url_identity(url: object) -> str:
    """The server a URL reaches, for telling engines apart: ``scheme://host:port/path`` with
    every name and address of this machine's loopback (``localhost``, ``127.0.0.1``, ``::1``,
    ``0.0.0.0``) as one host ``loopback``, IP addresses in canonical form, host names lower
    case and the default port explicit. No name is resolved (nothing is looked up); raises
    ``InvalidArgument`` for what ``SGLangHTTPEngine`` would refuse."""
    parts = urlsplit(_validate_url(url))
    host = (parts.hostname or "").lower().rstrip(".")
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if host in _LOOPBACK_NAMES or (
        address is not None and (address.is_loopback or address.is_unspecified)
    ):
        host = "loopback"
    elif address is not None:
        host = address.compressed
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{host}:{port}{parts.path.rstrip('/')}"


def _check_flag(name: str, value: object) -> bool:
    return check_flag(name, value)


def _check_str(name: str, value: object, *, optional: bool) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        kind = "a string or None" if optional else "a string"
        raise InvalidArgument(f"{name} must be {kind}, got {_shown(value)}")
    return value


def _check_str_list(name: str, value: object) -> list[str]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidArgument(f"{name} must be a list of strings, got {_shown(value)}")
    items = list(value)
    if not all(isinstance(item, str) for item in items):
        raise InvalidArgument(f"{name} must hold strings only")
    return items


def _check_name(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{name} must be a non-empty string, got {value!r}")
    return value


def _check_shapes(value: object) -> list[list[int]]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidArgument(f"shapes must be a list of lists of ints, got {_shown(value)}")
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


def parse_version(value: object) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a version string such as ``0.5.23``, ``0.5.23.post1`` or
    ``0.5.23-sim`` (the leading numbers count, a suffix does not); None if it has none."""
    if not isinstance(value, str):
        return None
    match = _VERSION.match(value)
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def _shown(value: object) -> str:
    """A value from an answer, short enough for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}..."


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
        self._url = _validate_url(url)
        if timeouts is None:
            timeouts = HTTPTimeouts()
        elif not isinstance(timeouts, HTTPTimeouts):
            raise InvalidArgument(f"timeouts must be an HTTPTimeouts, got {_shown(timeouts)}")
        self._timeouts = timeouts
        self._retries = check_int("retries", retries, maximum=_MAX_RETRIES)
        self._retry_backoff = check_seconds("retry_backoff", retry_backoff, positive=False)
        if transport is not None and not isinstance(transport, httpx.AsyncBaseTransport):
            raise InvalidArgument(
                f"transport must be an httpx.AsyncBaseTransport, got {_shown(transport)}"
            )
        self._transport = transport
        if label is None:
            label = self._url
        elif not isinstance(label, str) or not label:
            raise InvalidArgument(f"label must be a non-empty string, got {_shown(label)}")
        if self._scrub(label) != label or self._scrub(self._url) != self._url:
            raise InvalidArgument("label and url must not contain a key")
        self._label = label
        if not isinstance(weight_selector, str) or weight_selector not in WEIGHT_SELECTORS:
            valid = ", ".join(WEIGHT_SELECTORS)
            raise InvalidArgument(
                f"weight_selector must be one of {valid}, got {weight_selector!r}"
            )
        self._selector = weight_selector
        self._check_version = _check_flag("check_version", check_version)
        #: The SGLang version found by the attach check, once it passed.
        self._version: str | None = None
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
        response = await self._request(
            op, "POST", "/pause_generation", {"mode": mode.value}, self._timeouts.control
        )
        self._expect_no_refusal(op, response)

    async def continue_generation(self) -> None:
        """``POST /continue_generation {"torch_empty_cache": true}``; retried."""
        op = "continue_generation"
        await self._attach(op)
        response = await self._request(
            op, "POST", "/continue_generation", {"torch_empty_cache": True}, self._timeouts.control
        )
        self._expect_no_refusal(op, response)

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
        await self._attach(op)
        response = await self._request(
            op, "POST", f"/{op}", {"tags": names}, self._timeouts.memory, retry=False
        )
        self._expect_no_refusal(op, response)

    # ----------------------------------------------------------------------------- weights

    async def begin_weight_update(self) -> None:
        """``POST /begin_weight_update {"selector": S}`` with the client's ``weight_selector``."""
        op = "begin_weight_update"
        await self._attach(op)
        response = await self._request(
            op,
            "POST",
            "/begin_weight_update",
            # sglang: io_struct.py BeginWeightUpdateReqInput.selector (default "all"); the
            # updates of the session must name the same runners.
            {"selector": self._selector},
            self._timeouts.control,
            retry=False,
        )
        self._expect_success(op, response)

    async def end_weight_update(self) -> None:
        """``POST /end_weight_update {}``."""
        op = "end_weight_update"
        await self._attach(op)
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
        await self._attach(op)
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
        """``POST /update_weights_from_tensor`` (one base64 payload per TP rank), with the
        client's ``weight_selector``; sent once."""
        op = "update_weights_from_tensor"
        body = {
            "serialized_named_tensors": _check_str_list(
                "serialized_named_tensors", serialized_named_tensors
            ),
            "load_format": _check_str("load_format", load_format, optional=True),
            "weight_version": _check_str("weight_version", weight_version, optional=True),
            "flush_cache": _check_flag("flush_cache", flush_cache),
            "abort_all_requests": _check_flag("abort_all_requests", abort_all_requests),
            # sglang: io_struct.py UpdateWeightsFromTensorReqInput.selector
            "selector": self._selector,
        }
        await self._attach(op)
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
        load_format: str | None = None,
    ) -> None:
        """``POST /update_weights_from_distributed``, with the client's ``weight_selector``; the
        tensors arrive over ``group_name`` (made by ``init_weights_update_group``); sent once."""
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
            "load_format": _check_str("load_format", load_format, optional=True),
            "weight_version": _check_str("weight_version", weight_version, optional=True),
            "flush_cache": _check_flag("flush_cache", flush_cache),
            "abort_all_requests": _check_flag("abort_all_requests", abort_all_requests),
            # sglang: io_struct.py UpdateWeightsFromDistributedReqInput.selector
            "selector": self._selector,
        }
        await self._attach(op)
        response = await self._request(
            op,
            "POST",
            "/update_weights_from_distributed",
            body,
            self._timeouts.weights,
            retry=False,
        )
        self._expect_success(op, response)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
    ) -> None:
        """``POST /init_weights_update_group``: join the collective group the trainer (rank 0)
        broadcasts weights over; this server's ranks are ``rank_offset`` and up.

        It returns once the whole group has formed, so the trainer must join concurrently; sent
        once (a second join would form a second group), and bounded by the ``weights`` timeout.
        """
        # sglang: io_struct.py InitWeightsUpdateGroupReqInput (master_address, master_port,
        # rank_offset, world_size, group_name, backend); http_server.py init_weights_update_group
        op = "init_weights_update_group"
        if not isinstance(master_address, str) or not master_address:
            raise InvalidArgument(
                f"master_address must be a non-empty string, got {master_address!r}"
            )
        for name, value, low in (
            ("master_port", master_port, 1),
            ("rank_offset", rank_offset, 1),
            ("world_size", world_size, 2),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgument(f"{name} must be an int >= {low}, got {value!r}")
        if master_port > 65535:
            raise InvalidArgument(f"master_port must be at most 65535, got {master_port!r}")
        if rank_offset >= world_size:
            raise InvalidArgument(
                f"rank_offset {rank_offset} must be below world_size {world_size}"
            )
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": _check_name("group_name", group_name),
            "backend": _check_name("backend", backend),
        }
        await self._attach(op)
        response = await self._request(
            op, "POST", "/init_weights_update_group", body, self._timeouts.weights, retry=False
        )
        self._expect_success(op, response)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> None:
        """``POST /destroy_weights_update_group {"group_name"}``: leave the collective group."""
        # sglang: io_struct.py DestroyWeightsUpdateGroupReqInput (group_name);
        # http_server.py destroy_weights_update_group
        op = "destroy_weights_update_group"
        body = {"group_name": _check_name("group_name", group_name)}
        await self._attach(op)
        response = await self._request(
            op, "POST", "/destroy_weights_update_group", body, self._timeouts.control, retry=False
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
        await self._attach(op)
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
        and hang on a paused server. SGLang publishes its keys here in clear (server arguments
        ``api_key`` and ``admin_api_key``, and ``launch_command``); they come back masked, as
        do other secret arguments and any occurrence of this client's keys.
        """
        # sglang: common.py build_server_info (server_args.resolved_dict() + launch_command)
        return await self._info("server_info", "/server_info", "/get_server_info")

    async def ready(self, timeout: float | None = None) -> bool:
        """One ``GET /ready``, not retried: True on 200 only.

        SGLang answers 200 when the server is up (after warm-up) and not paused, 503 otherwise;
        ``/model_info`` answers before warm-up and is no readiness probe. False also when the
        server cannot answer (connection refused or dropped, timed out, 502/504). Other answers
        raise. A paused server is not ready: False from an engine that may be paused says
        nothing of its liveness (``server_info()`` is the liveness probe).
        """
        # sglang: http_server.py ready() -> tokenizer_manager.py TokenizerManager.is_ready
        # (not self.is_pause and self.is_healthy())
        try:
            await self._request(
                "ready", "GET", "/ready", None, self._probe_wait(timeout), retry=False
            )
        except (EngineDead, EngineUnreachable, EngineTimeout):
            return False
        except EngineRejected as exc:
            if exc.status in _RETRY_STATUSES:
                return False
            raise
        return True

    async def _ready_status(self, timeout: float | None = None) -> int | None:
        """One ``GET /ready``, not retried: the status of whatever answers at the URL (503
        from a paused or warming-up SGLang), or None when nothing does."""
        try:
            response = await self._request(
                "ready", "GET", "/ready", None, self._probe_wait(timeout), retry=False
            )
        except (EngineDead, EngineUnreachable, EngineTimeout):
            return None
        except EngineRejected as exc:
            return exc.status
        return response.status_code

    def _probe_wait(self, timeout: float | None) -> float:
        if timeout is None:
            return self._timeouts.probe
        return max(0.001, min(check_seconds("ready timeout", timeout), self._timeouts.probe))

    async def check_version(self, op: str = "check_version") -> str:
        """Read ``version`` from ``/server_info`` and refuse an SGLang older than 0.5.22.

        Returns the version found; remembers it, so that the attach check before lifecycle
        calls does not ask again. Raises ``IllegalEngineOp`` (naming the version found) when it
        is too old, missing or unreadable; engine errors of the probe itself pass through.
        """
        info = await self._info(op, "/server_info", "/get_server_info")
        found = info.get("version")
        wanted = ".".join(str(n) for n in MIN_SGLANG_VERSION)
        if found is None:
            raise IllegalEngineOp(
                self._label,
                op,
                f"/server_info reports no SGLang version; this client needs SGLang >= {wanted} "
                "and sends no lifecycle call to a server it cannot identify",
            )
        parsed = parse_version(found)
        if parsed is None:
            raise IllegalEngineOp(
                self._label,
                op,
                f"/server_info reports SGLang version {_shown(found)}, which is not a version "
                f"number; this client needs SGLang >= {wanted}",
            )
        if parsed < MIN_SGLANG_VERSION:
            raise IllegalEngineOp(
                self._label,
                op,
                f"the server runs SGLang {_shown(found)}, older than {wanted}, the oldest this "
                "client drives (0.5.20 has no weight-update sessions and its release after a "
                "retract pause kills it; 0.5.21 dies on an update that flushes a busy engine)",
            )
        assert isinstance(found, str)
        self._version = found
        return found

    async def _attach(self, op: str) -> None:
        """The attach check, once per client, before its first lifecycle call."""
        if self._check_version and self._version is None:
            await self.check_version(op)

    async def _info(self, op: str, path: str, old_path: str) -> dict[str, Any]:
        """A probe's JSON object, from ``path`` or, on a server that predates it, ``old_path``.

        Secrets in it are masked here, so no raw copy leaves this method.
        """
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
        masked = self._mask_keys(data)
        assert isinstance(masked, dict)
        return masked

    # ----------------------------------------------------------------------------- requests

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """``POST /generate``, run to completion; sent once. Streaming is not supported here."""
        op = "generate"
        if not isinstance(request, dict):
            raise InvalidArgument(f"request must be a dict, got {_shown(request)}")
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
        """``POST /abort_request {"rid", "abort_all"}``: abort the request whose id is ``rid``
        exactly, or every request with ``abort_all``.

        With one tokenizer worker (SGLang's default) the rid must equal a live request's id: a
        prefix or an unknown rid aborts nothing, and ``rid=""`` without ``abort_all`` is
        ignored. Sent once; the answer (200, empty) does not say whether anything was aborted.
        """
        # sglang: tokenizer_manager.py TokenizerManager.abort_request (rid_to_state.get(rid);
        # no state and tokenizer_worker_num == 1 -> return)
        if not isinstance(rid, str):
            raise InvalidArgument(f"rid must be a string, got {_shown(rid)}")
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
        """A copy of a JSON value with secret fields (``api_key``, ``admin_api_key``, passwords),
        secret flags' values in command lines (``launch_command``) and our keys masked."""
        if isinstance(value, dict):
            return {
                k: (
                    _MASK
                    if v and isinstance(k, str) and _SECRET_FIELD.search(k)
                    else self._mask_keys(v)
                )
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [self._mask_keys(v) for v in value]
        if isinstance(value, str):
            return _SECRET_FLAG.sub(lambda m: m.group(1) + _MASK, self._scrub(value))
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
        With a ``flush_wait`` > 0 the query carries ``timeout``: what is left of it on each
        attempt; with 0 it carries none.
        """
        client = self._client_for_loop(op)
        key = (
            None
            if path.startswith(_OPEN_PREFIXES)
            else self._key_for(control=path not in _NORMAL_PATHS)
        )
        headers = {"Authorization": f"Bearer {key[1].reveal()}"} if key is not None else {}
        attempts = 1 + self._retries if retry else 1
        first = time.monotonic()
        for attempt in range(1, attempts + 1):
            params: dict[str, str] | None = None
            timeout = read_timeout
            if flush_wait is not None:
                left = max(0.0, flush_wait - (time.monotonic() - first))
                if flush_wait > 0:
                    # A deferred flush; with no timeout (0) the query is left out altogether.
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
