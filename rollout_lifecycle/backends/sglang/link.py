"""One client's link to one SGLang server: the options it was made with (URL, keys, label,
timeouts, retries, weight selector), the call of an endpoint of the table (``sglang.api``) with
its answer read as the row says, the information reads with secrets masked, the probes, and the
attach check of the server's SGLang version. ``SGLangHTTPEngine`` builds each lifecycle, weight
and generate call's body and sends it over its link."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, NoReturn

import httpx

from rollout_lifecycle.backends.engine import incarnation_of
from rollout_lifecycle.backends.http.transport import (
    RETRY_STATUSES,
    open_wire,
)
from rollout_lifecycle.backends.http.wire import HTTPTimeouts, parse_version, shown
from rollout_lifecycle.backends.secret import Secret, as_secret
from rollout_lifecycle.backends.sglang.api import ENDPOINTS
from rollout_lifecycle.contract.exceptions import (
    EngineDead,
    EngineRejected,
    EngineTimeout,
    EngineUnhealthy,
    EngineUnreachable,
    IllegalEngineOp,
    InvalidArgument,
)
from rollout_lifecycle.contract.values import check_flag, check_seconds

#: The oldest SGLang this client drives: 0.5.20 has no begin/end weight-update endpoints and its
#: release asserts plain idleness (a retract pause that left requests waiting kills it); 0.5.21
#: dies on a weight update with ``flush_cache: true`` on a busy engine.
MIN_SGLANG_VERSION: tuple[int, int, int] = (0, 5, 22)
#: The runners a weight-update session and its updates apply to.
# sglang: io_struct.py BeginWeightUpdateReqInput / UpdateWeightsFromTensorReqInput /
# UpdateWeightsFromDistributedReqInput.selector: Literal["target", "draft", "all"] = "all"
WEIGHT_SELECTORS: tuple[str, ...] = ("target", "draft", "all")


class SGLangLink:
    """The link of one ``SGLangHTTPEngine`` to its server (see the module docstring); the
    engine's arguments are checked here, each naming the bad value."""

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
        self._wire, self._timeouts = open_wire(
            url,
            label,
            admin_key=self._admin_key,
            api_key=self._api_key,
            timeouts=timeouts,
            retries=retries,
            retry_backoff=retry_backoff,
            transport=transport,
        )
        self._url, self._label = self._wire.url, self._wire.label
        if not isinstance(weight_selector, str) or weight_selector not in WEIGHT_SELECTORS:
            valid = ", ".join(WEIGHT_SELECTORS)
            raise InvalidArgument(
                f"weight_selector must be one of {valid}, got {weight_selector!r}"
            )
        self._selector = weight_selector
        self._check_version = check_flag("check_version", check_version)
        #: The SGLang version found by the attach check, once it passed.
        self._version: str | None = None
        #: The data-parallel ranks the last ``/server_info`` named (``dp_size``).
        self._ranks = 1
        #: What the last ``/server_info`` said the server serves as (``role``).
        self._role: tuple[str, int | None] = ("regular", None)

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self._url

    @property
    def label(self) -> str:
        """The engine's name in errors and events (the URL unless given)."""
        return self._label

    @property
    def timeouts(self) -> HTTPTimeouts:
        """The timeouts in force."""
        return self._timeouts

    @property
    def selector(self) -> str:
        """The selector sent to ``/begin_weight_update`` and every tensor/distributed update."""
        return self._selector

    @property
    def ranks(self) -> int:
        """The data-parallel ranks behind the URL (``dp_size``), as the last ``/server_info``
        read said: each rank is a scheduler process holding the whole model. 1 before any."""
        return self._ranks

    @property
    def role(self) -> tuple[str, int | None]:
        """What the server serves as, as the last ``/server_info`` read said: its router worker
        type (``regular``, ``prefill`` or ``decode``: ``--disaggregation-mode``) and, for a
        prefill server, its bootstrap port. ``("regular", None)`` before any."""
        return self._role

    @property
    def version(self) -> str | None:
        """The SGLang version the attach check accepted (None before it ran, or when skipped)."""
        return self._version

    def arguments(self) -> str:
        """The link's arguments as a repr shows them (keys masked by ``Secret``)."""
        return (
            f"{self._url!r}, label={self._label!r}, "
            f"admin_key={self._admin_key!r}, api_key={self._api_key!r}"
        )

    def __repr__(self) -> str:
        return f"SGLangLink({self.arguments()})"

    async def close(self) -> None:
        """Close the HTTP client; later calls raise ``EngineDead``. Idempotent, never raises."""
        await self._wire.close()

    # ----------------------------------------------------------------------------- probes

    async def model_info(self) -> dict[str, Any]:
        """``GET /model_info`` (old name ``/get_model_info``); retried."""
        return await self.info("model_info")

    async def weight_version(self) -> str | None:
        """The loaded weight version, from ``GET /model_info``."""
        info = await self.model_info()
        version = info.get("weight_version")
        if version is not None and not isinstance(version, str):
            self._wire.garbage("weight_version", "/model_info", "weight_version is not a string")
        return version

    async def server_info(self) -> dict[str, Any]:
        """``GET /server_info`` (old name ``/get_server_info``): the liveness probe.

        Safe while paused, unlike ``/health`` and ``/health_generate``, which run a generation
        and hang on a paused server. SGLang publishes its keys here in clear (server arguments
        ``api_key`` and ``admin_api_key``, and ``launch_command``); they come back masked, as
        do other secret arguments and any occurrence of this client's keys.
        """
        return await self._server_info("server_info")

    async def _server_info(self, op: str) -> dict[str, Any]:
        """``GET /server_info`` for ``op``; keeps the data-parallel ranks it names (``ranks``).

        On a server of several ranks the read waits for every rank, so it is the check that the
        server is whole: it gets half the probe timeout, and unanswered while ``/ping`` answers
        (the front end's own health) the server is not whole, ``EngineUnhealthy``. A rank whose
        process died leaves such a server: its front end and the other ranks live on, and
        nothing restarts the rank."""
        # sglang: http_server.py server_info -> tokenizer_control_mixin.py get_internal_state,
        # a FanOutCommunicator (communicator.py) that returns once every rank has answered and
        # queues each later read behind one that has not
        ranks = self._ranks
        wait = self._timeouts.probe / 2 if ranks > 1 else None
        try:
            # sglang: common.py build_server_info (server_args.resolved_dict() + launch_command)
            info = await self.info("server_info", op, timeout=wait)
        except EngineTimeout:
            if wait is not None and await self.ping():
                raise EngineUnhealthy(self.label, op, ranks, wait) from None
            raise
        # sglang: server_args.py ServerArgs.dp_size (absent from a server that predates it)
        ranks = info.get("dp_size", 1)
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            self._wire.garbage(op, "/server_info", f"dp_size is {shown(ranks)}")
        self._ranks = ranks
        self._role = self._role_in(op, info)
        return info

    def _role_in(self, op: str, info: dict[str, Any]) -> tuple[str, int | None]:
        """The worker type and bootstrap port a ``/server_info`` answer names."""
        # sglang: arg_groups/fields/disagg.py Disagg.disaggregation_mode ("null", "prefill" or
        # "decode") and disaggregation_bootstrap_port (the prefill server's bootstrap server)
        mode = info.get("disaggregation_mode", "null")
        if mode in (None, "null"):
            return ("regular", None)
        if mode not in ("prefill", "decode"):
            self._wire.garbage(op, "/server_info", f"disaggregation_mode is {shown(mode)}")
        if mode == "decode":
            return ("decode", None)  # (its bootstrap port is unused: the prefill's serves)
        port = info.get("disaggregation_bootstrap_port")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            self._wire.garbage(
                op, "/server_info", f"disaggregation_bootstrap_port is {shown(port)}"
            )
        return ("prefill", port)

    async def observe(self, *, paused: bool = True, identify: bool = True) -> dict[str, Any]:
        """What the server says of itself (``EngineHost.observe``), its reads sent at once:
        the incarnation ``/server_info`` names (``identify``), and whether it is paused
        (``paused``: a server that answers ``/ping`` and not ``/ready`` is paused; one that
        does not answer ``/ping`` cannot tell). A server of several ranks is read whole every
        time (``_server_info``): a checked call is never sent to one that is not."""
        whole = identify or self._ranks > 1  # (a server of several ranks: is it whole?)
        reads: list[Awaitable[Any]] = []
        if whole:
            reads.append(self.server_info())
        if paused:
            reads += [self.ping(), self.ready()]
        answers = list(await asyncio.gather(*reads))
        info = answers.pop(0) if whole else None
        found: dict[str, Any] = {"incarnation": None, "paused": None}
        if identify and info is not None:
            found["incarnation"] = incarnation_of(info)
        if paused:
            healthy, serving = answers
            found["paused"] = None if not healthy else not serving
        return found

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
        return await self._answers("ready", timeout)

    async def ping(self, timeout: float | None = None) -> bool:
        """One ``GET /ping``, not retried: True on 200 only.

        SGLang answers 200 when the server is up and healthy, *paused or not*, and 503
        otherwise, so a server that answers ``/ping`` and not ``/ready`` is paused. False also
        when the server cannot answer, or has no ``/ping`` (404): then nothing can be told of
        its pause from outside. Other answers raise.
        """
        # sglang: http_server.py sagemaker_health (/ping: 200 when is_healthy(); unlike /ready
        # a paused server answers 200); auth.py decide_request_auth (a normal endpoint)
        try:
            return await self._answers("ping", timeout)
        except EngineRejected as exc:
            if exc.status == 404:
                return False
            raise

    async def _answers(self, probe: str, timeout: float | None) -> bool:
        """Whether one call of the probe ``probe`` is answered 200; False for 502-504 and for a
        server that cannot answer; other refusals raise."""
        try:
            await self.call(probe, timeout=self._probe_wait(timeout))
        except (EngineDead, EngineUnreachable, EngineTimeout):
            return False
        except EngineRejected as exc:
            if exc.status in RETRY_STATUSES:
                return False
            raise
        return True

    async def ready_status(self, timeout: float | None = None) -> int | None:
        """One ``GET /ready``, not retried: the status of whatever answers at the URL (503
        from a paused or warming-up SGLang), or None when nothing does."""
        return await self._wire.status(ENDPOINTS["ready"], self._probe_wait(timeout))

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
        info = await self._server_info(op)
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
                f"/server_info reports SGLang version {shown(found)}, which is not a version "
                f"number; this client needs SGLang >= {wanted}",
            )
        if parsed < MIN_SGLANG_VERSION:
            raise IllegalEngineOp(
                self._label,
                op,
                f"the server runs SGLang {shown(found)}, older than {wanted}, the oldest this "
                "client drives (0.5.20 has no weight-update sessions and its release after a "
                "retract pause kills it; 0.5.21 dies on an update that flushes a busy engine)",
            )
        assert isinstance(found, str)
        self._version = found
        return found

    async def attach(self, op: str) -> None:
        """The attach check, once per client, before its first lifecycle call."""
        if self._check_version and self._version is None:
            await self.check_version(op)

    async def call(
        self,
        name: str,
        body: dict[str, Any] | None = None,
        *,
        op: str | None = None,
        path: str | None = None,
        timeout: float | None = None,
        flush_wait: float | None = None,
    ) -> Any:
        """One call to the endpoint ``name`` of the table (``sglang.api``): its method, key,
        timeout and retries from its row, and its answer read as the row's shape says (the JSON
        object of an ``object`` answer, else None)."""
        row = ENDPOINTS[name]
        if body is not None and row.fields:
            # SGLang ignores a body key it does not know: a misspelt flag would be dropped
            # without a word, so the client sends only fields its table row declares.
            unknown = body.keys() - row.body_fields
            if unknown:
                raise AssertionError(f"{row.path} has no field {sorted(unknown)}; see sglang.api")
        wait = getattr(self._timeouts, row.timeout) if timeout is None else timeout
        response = await self._wire.request(
            row, body, wait, op=op, path=path, flush_wait=flush_wait
        )
        return self._wire.read_answer(row.name if op is None else op, row, response)

    def garbage(self, op: str, path: str, why: str) -> NoReturn:
        """Raise the ``EngineError`` of an answer that is not what ``path`` answers."""
        self._wire.garbage(op, path, why)

    async def info(
        self, name: str, op: str | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """An information endpoint's JSON object, from its path or, on a server that predates
        it, its older alias.

        Secrets in it are masked here, so no raw copy leaves this method.
        """
        paths = ENDPOINTS[name].paths
        for i, path in enumerate(paths):
            try:
                data = await self.call(name, op=op, path=path, timeout=timeout)
                break
            except EngineRejected as exc:
                if exc.status != 404 or i == len(paths) - 1:
                    raise
        masked = self._wire.mask_keys(data)
        assert isinstance(masked, dict)
        return masked


__all__ = ["MIN_SGLANG_VERSION", "WEIGHT_SELECTORS", "SGLangLink"]
