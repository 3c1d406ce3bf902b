"""The weight-update calls and the probes of ``SGLangHTTPEngine`` (its base class): weight
sessions and updates sent exactly once with every flag explicit, ``/server_info`` and
``/model_info`` read, and the attach check of the server's SGLang version."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from rollout_lifecycle.backends.engine import incarnation_of
from rollout_lifecycle.backends.http_transport import RETRY_STATUSES, HTTPTransport
from rollout_lifecycle.backends.http_wire import (
    HTTPTimeouts,
    check_name,
    check_shapes,
    check_str,
    check_str_list,
    parse_version,
    shown,
)
from rollout_lifecycle.backends.sglang_api import ENDPOINTS
from rollout_lifecycle.contract.exceptions import (
    EngineDead,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
    IllegalEngineOp,
    InvalidArgument,
)
from rollout_lifecycle.contract.values import DEFAULT_GROUP_NAME, check_flag, check_seconds

#: The oldest SGLang this client drives: 0.5.20 has no begin/end weight-update endpoints and its
#: release asserts plain idleness (a retract pause that left requests waiting kills it); 0.5.21
#: dies on a weight update with ``flush_cache: true`` on a busy engine.
MIN_SGLANG_VERSION: tuple[int, int, int] = (0, 5, 22)


class SGLangCalls:
    """Weight calls and probes over an ``HTTPTransport``; ``SGLangHTTPEngine`` sets the state."""

    _url: str
    _label: str
    _wire: HTTPTransport
    _timeouts: HTTPTimeouts
    _selector: str
    _check_version: bool
    _version: str | None

    # ----------------------------------------------------------------------------- weights

    async def begin_weight_update(self) -> None:
        """``POST /begin_weight_update {"selector": S}`` with the client's ``weight_selector``."""
        op = "begin_weight_update"
        await self._attach(op)
        # sglang: io_struct.py BeginWeightUpdateReqInput.selector (default "all"); the updates
        # of the session must name the same runners.
        await self._call(op, {"selector": self._selector})

    async def end_weight_update(self) -> None:
        """``POST /end_weight_update {}``."""
        op = "end_weight_update"
        await self._attach(op)
        await self._call(op, {})

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
            "load_format": check_str("load_format", load_format, optional=True),
            "weight_version": check_str("weight_version", weight_version, optional=True),
            "flush_cache": check_flag("flush_cache", flush_cache),
            "abort_all_requests": check_flag("abort_all_requests", abort_all_requests),
        }
        await self._attach(op)
        await self._call(op, body)

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
            "serialized_named_tensors": check_str_list(
                "serialized_named_tensors", serialized_named_tensors
            ),
            "load_format": check_str("load_format", load_format, optional=True),
            "weight_version": check_str("weight_version", weight_version, optional=True),
            "flush_cache": check_flag("flush_cache", flush_cache),
            "abort_all_requests": check_flag("abort_all_requests", abort_all_requests),
            # sglang: io_struct.py UpdateWeightsFromTensorReqInput.selector
            "selector": self._selector,
        }
        await self._attach(op)
        await self._call(op, body)

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
        names = check_str_list("names", names)
        dtypes = check_str_list("dtypes", dtypes)
        shape_list = check_shapes(shapes)
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
            "load_format": check_str("load_format", load_format, optional=True),
            "weight_version": check_str("weight_version", weight_version, optional=True),
            "flush_cache": check_flag("flush_cache", flush_cache),
            "abort_all_requests": check_flag("abort_all_requests", abort_all_requests),
            # sglang: io_struct.py UpdateWeightsFromDistributedReqInput.selector
            "selector": self._selector,
        }
        await self._attach(op)
        await self._call(op, body)

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
            "group_name": check_name("group_name", group_name),
            "backend": check_name("backend", backend),
        }
        await self._attach(op)
        await self._call(op, body)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> None:
        """``POST /destroy_weights_update_group {"group_name"}``: leave the collective group."""
        # sglang: io_struct.py DestroyWeightsUpdateGroupReqInput (group_name);
        # http_server.py destroy_weights_update_group
        op = "destroy_weights_update_group"
        body = {"group_name": check_name("group_name", group_name)}
        await self._attach(op)
        await self._call(op, body)

    async def update_weight_version(self, version: str, *, abort_all_requests: bool) -> None:
        """``POST /update_weight_version``; ``abort_all_requests`` is always sent (server default
        is true, which would abort the requests a retract pause preserved)."""
        op = "update_weight_version"
        body = {
            "new_version": check_str("version", version, optional=False),
            "abort_all_requests": check_flag("abort_all_requests", abort_all_requests),
        }
        await self._attach(op)
        await self._call(op, body)

    # ----------------------------------------------------------------------------- probes

    async def model_info(self) -> dict[str, Any]:
        """``GET /model_info`` (old name ``/get_model_info``); retried."""
        return await self._info("model_info")

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
        # sglang: common.py build_server_info (server_args.resolved_dict() + launch_command)
        return await self._info("server_info")

    async def observe(self, *, paused: bool = True, identify: bool = True) -> dict[str, Any]:
        """What the server says of itself (``EngineHost.observe``), its reads sent at once:
        the incarnation ``/server_info`` names (``identify``), and whether it is paused
        (``paused``: a server that answers ``/ping`` and not ``/ready`` is paused; one that
        does not answer ``/ping`` cannot tell)."""
        reads: list[Awaitable[Any]] = []
        if identify:
            reads.append(self.server_info())
        if paused:
            reads += [self.ping(), self.ready()]
        answers = list(await asyncio.gather(*reads))
        info = answers.pop(0) if identify else None
        found: dict[str, Any] = {"incarnation": None, "paused": None}
        if info is not None:
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
            await self._call(probe, timeout=self._probe_wait(timeout))
        except (EngineDead, EngineUnreachable, EngineTimeout):
            return False
        except EngineRejected as exc:
            if exc.status in RETRY_STATUSES:
                return False
            raise
        return True

    async def _ready_status(self, timeout: float | None = None) -> int | None:
        """One ``GET /ready``, not retried: the status of whatever answers at the URL (503
        from a paused or warming-up SGLang), or None when nothing does."""
        try:
            response = await self._wire.request(ENDPOINTS["ready"], None, self._probe_wait(timeout))
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
        info = await self._info("server_info", op)
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

    async def _attach(self, op: str) -> None:
        """The attach check, once per client, before its first lifecycle call."""
        if self._check_version and self._version is None:
            await self.check_version(op)

    async def _call(
        self,
        name: str,
        body: dict[str, Any] | None = None,
        *,
        op: str | None = None,
        path: str | None = None,
        timeout: float | None = None,
        flush_wait: float | None = None,
    ) -> Any:
        """One call to the endpoint ``name`` of the table (``sglang_api``): its method, key,
        timeout and retries from its row, and its answer read as the row's shape says (the JSON
        object of an ``object`` answer, else None)."""
        row = ENDPOINTS[name]
        if body is not None and row.fields:
            # SGLang ignores a body key it does not know: a misspelt flag would be dropped
            # without a word, so the client sends only fields its table row declares.
            unknown = body.keys() - row.body_fields
            if unknown:
                raise AssertionError(f"{row.path} has no field {sorted(unknown)}; see sglang_api")
        wait = getattr(self._timeouts, row.timeout) if timeout is None else timeout
        response = await self._wire.request(
            row, body, wait, op=op, path=path, flush_wait=flush_wait
        )
        return self._wire.read_answer(row.name if op is None else op, row, response)

    async def _info(self, name: str, op: str | None = None) -> dict[str, Any]:
        """An information endpoint's JSON object, from its path or, on a server that predates
        it, its older alias.

        Secrets in it are masked here, so no raw copy leaves this method.
        """
        paths = ENDPOINTS[name].paths
        for i, path in enumerate(paths):
            try:
                data = await self._call(name, op=op, path=path)
                break
            except EngineRejected as exc:
                if exc.status != 404 or i == len(paths) - 1:
                    raise
        masked = self._wire.mask_keys(data)
        assert isinstance(masked, dict)
        return masked


__all__ = ["MIN_SGLANG_VERSION", "SGLangCalls"]
