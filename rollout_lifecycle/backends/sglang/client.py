"""The production ``EngineBackend``: an async HTTP client of one SGLang 0.5.23 server.

Explicit bodies, a key per endpoint, retries only where repeating is harmless, one error boundary.
This module has the engine: each lifecycle, weight and generate call checks its arguments and
builds its body. It sends them over its link to the server (``sglang.link``: endpoint calls,
probes, the attach check), which sends through its transport (``http.transport``: retries,
error translation); timeouts and value checks are ``http.wire``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from rollout_lifecycle.backends.http.wire import (
    HTTPTimeouts,
    check_name,
    check_shapes,
    check_str,
    check_str_list,
    shown,
)
from rollout_lifecycle.backends.secret import Secret, secret_kwargs
from rollout_lifecycle.backends.sglang.api import SESSION_ALREADY_OPEN
from rollout_lifecycle.backends.sglang.link import SGLangLink
from rollout_lifecycle.backends.tensor_payload import check_tensor_payloads
from rollout_lifecycle.contract.capabilities import Capabilities
from rollout_lifecycle.contract.exceptions import (
    EngineRejected,
    IllegalEngineOp,
    InvalidArgument,
)
from rollout_lifecycle.contract.fingerprint import SGLANG_SCHEME, Fingerprint
from rollout_lifecycle.contract.ops import Op
from rollout_lifecycle.contract.outcome import SESSION_OPEN
from rollout_lifecycle.contract.values import (
    DEFAULT_GROUP_NAME,
    PauseMode,
    Tag,
    check_flag,
    check_seconds,
    member,
    parse_tags,
)

__all__ = ["SGLangHTTPEngine", "sglang_http_factory"]


#: What SGLang can do (``contract/capabilities``): each tag released and resumed on its own;
#: weights written from disk, from tensors and over a collective group; checksums that are
#: 64-bit sha256 prefixes (``weight_fingerprint``).
SGLANG_CAPABILITIES = Capabilities("sglang", fingerprint_scheme=SGLANG_SCHEME)
#: The writes a data-parallel SGLang server refuses: its tokenizer manager asserts
#: ``dp_size == 1`` before each (sglang: tokenizer_control_mixin.py
#: TokenizerControlMixin.init_weights_update_group, destroy_weights_update_group,
#: update_weights_from_distributed, update_weights_from_tensor), which the server answers 500.
_SINGLE_RANK_WRITES = frozenset(
    {
        Op.UPDATE_FROM_TENSOR,
        Op.UPDATE_FROM_DISTRIBUTED,
        Op.INIT_UPDATE_GROUP,
        Op.DESTROY_UPDATE_GROUP,
    }
)

_SINGLE_RANK_OPS = frozenset(op.value for op in _SINGLE_RANK_WRITES)


@functools.cache
def data_parallel(ranks: int, base: Capabilities = SGLANG_CAPABILITIES) -> Capabilities:
    """What an SGLang server with ``ranks`` data-parallel ranks (``--dp-size``) can do: what
    ``base`` (one rank's) can, but its weights are written from disk only
    (``_SINGLE_RANK_WRITES``)."""
    return dataclasses.replace(
        base,
        weight_writes=base.weight_writes - _SINGLE_RANK_WRITES,
        ranks=ranks,
        writes_limited_by=(
            f"a data-parallel SGLang server (dp_size {ranks}) refuses tensor and collective "
            f"weight writes: its tokenizer manager asserts dp_size == 1"
        ),
    )


@functools.cache
def serving_as(
    base: Capabilities, worker_type: str, bootstrap_port: int | None = None
) -> Capabilities:
    """``base`` for a server that serves as ``worker_type`` (``regular``, or a ``prefill`` or
    ``decode`` half of a prefill/decode pair), with ``bootstrap_port`` if it is a prefill
    server (the port is a prefill server's alone: any other type keeps None)."""
    if worker_type != "prefill":
        bootstrap_port = None
    if (worker_type, bootstrap_port) == (base.worker_type, base.bootstrap_port):
        return base
    return dataclasses.replace(base, worker_type=worker_type, bootstrap_port=bootstrap_port)


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

    @property
    def capabilities(self) -> Capabilities:
        """What the server can do (``contract/capabilities``): ``SGLANG_CAPABILITIES``, or
        ``data_parallel(ranks)`` when the last ``/server_info`` named more than one rank, each
        with the router worker type it named (``serving_as``; the engine host reads them with
        the incarnation, so they are the process's)."""
        ranks, (worker_type, bootstrap_port) = self._link.ranks, self._link.role
        declared = SGLANG_CAPABILITIES if ranks == 1 else data_parallel(ranks)
        return serving_as(declared, worker_type, bootstrap_port)

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
        self._link = SGLangLink(
            url,
            admin_key=admin_key,
            api_key=api_key,
            timeouts=timeouts,
            retries=retries,
            retry_backoff=retry_backoff,
            transport=transport,
            label=label,
            weight_selector=weight_selector,
            check_version=check_version,
        )

    # ----------------------------------------------------------------------------- properties

    @property
    def link(self) -> SGLangLink:
        """The link to the server: endpoint calls, probes, the attach check."""
        return self._link

    @property
    def label(self) -> str:
        """The engine's name in errors and events (the URL unless given)."""
        return self._link.label

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self._link.url

    @property
    def timeouts(self) -> HTTPTimeouts:
        """The timeouts in force."""
        return self._link.timeouts

    @property
    def weight_selector(self) -> str:
        """The selector sent to ``/begin_weight_update`` and every tensor/distributed update."""
        return self._link.selector

    @property
    def sglang_version(self) -> str | None:
        """The SGLang version the attach check accepted (None before it ran, or when skipped)."""
        return self._link.version

    def __repr__(self) -> str:
        return f"SGLangHTTPEngine({self._link.arguments()})"

    async def _send(self, op: str, body: dict[str, Any] | None = None, **how: Any) -> None:
        """The attach check (once), then one call of the endpoint ``op``; a write the server is
        known to refuse (``data_parallel``) is refused here, unsent."""
        await self._link.attach(op)
        if op in _SINGLE_RANK_OPS and self._link.ranks > 1:
            limit = self.capabilities.writes_limited_by
            raise IllegalEngineOp(self.label, op, f"{limit}; write the weights from disk")
        await self._link.call(op, body, **how)

    # ----------------------------------------------------------------------------- lifecycle

    async def pause_generation(self, mode: PauseMode) -> None:
        """``POST /pause_generation {"mode": ...}``; retried (a repeated pause does no harm).

        SGLang has no wait mode. For ``PauseMode.WAIT`` the client first waits for the engine to
        go idle, every request in flight run to its end: ``POST /flush_cache?timeout=T`` with T
        the ``drain`` timeout, which SGLang answers once nothing runs or waits (and flushes
        then). Then it pauses in retract mode, so a request that arrived in between is held,
        not lost. Requests keep arriving at an engine that has clients besides this library:
        if it is never idle for T, the pause fails (``EngineRejected``) with nothing paused.
        """
        op = "pause_generation"
        mode = member(PauseMode, mode, "pause mode")
        if mode is PauseMode.WAIT:
            # sglang: flush_wrapper.py SchedulerFlushWrapper.check_pending (a deferred flush
            # waits for is_fully_idle(), the waiting queue counted, while not paused);
            # io_struct.py PauseGenerationReqInput.mode (abort, retract, in_place: no wait).
            drain = self._link.timeouts.drain
            await self._link.attach(op)
            try:
                await self._link.call("flush_cache", op=op, flush_wait=drain)
            except EngineRejected as exc:
                if exc.status != 400:
                    raise
                raise EngineRejected(
                    self.label,
                    op,
                    f"wait mode: requests were still in flight after {drain:g}s (the drain "
                    f"timeout); nothing was paused; SGLang said: {exc.message}",
                    400,
                ) from None
            mode = PauseMode.RETRACT
        await self._send(op, {"mode": mode.value})

    async def continue_generation(self) -> None:
        """``POST /continue_generation {"torch_empty_cache": true}``; retried."""
        op = "continue_generation"
        await self._send(op, {"torch_empty_cache": True})

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
        await self._send("flush_cache", flush_wait=wait)

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
        await self._send(op, {"tags": names})

    # ----------------------------------------------------------------------------- requests

    async def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """``POST /generate``, run to completion; sent once. Streaming is not supported here."""
        op = "generate"
        if not isinstance(request, dict):
            raise InvalidArgument(f"request must be a dict, got {shown(request)}")
        if request.get("stream"):
            raise InvalidArgument("generate() does not stream; send the request with stream false")
        # An object answer: a batch (a list) is garbage here.
        data: dict[str, Any] = await self._link.call(op, request)
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
        await self._link.call("abort_request", body)

    # ----------------------------------------------------------------------------- weights

    async def begin_weight_update(self) -> None:
        """``POST /begin_weight_update {"selector": S}`` with the client's ``weight_selector``;
        a session already open is refused with ``SESSION_OPEN``."""
        op = "begin_weight_update"
        # sglang: io_struct.py BeginWeightUpdateReqInput.selector (default "all"); the updates
        # of the session must name the same runners.
        try:
            await self._send(op, {"selector": self._link.selector})
        except EngineRejected as exc:
            # sglang: weight_updater.py begin_weight_update answers 400 with its text; the
            # backends' word for a session already open is SESSION_OPEN
            if exc.status == 400 and SESSION_ALREADY_OPEN in exc.message:
                raise EngineRejected(exc.engine, exc.op, exc.message, SESSION_OPEN) from None
            raise

    async def end_weight_update(self) -> None:
        """``POST /end_weight_update {}``."""
        op = "end_weight_update"
        await self._send(op, {})

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
        body = {
            "model_path": check_name("model_path", model_path),
            **_update_flags(load_format, weight_version, flush_cache, abort_all_requests),
        }
        await self._send(op, body)

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
            "serialized_named_tensors": check_tensor_payloads(
                "serialized_named_tensors",
                check_str_list("serialized_named_tensors", serialized_named_tensors),
            ),
            **_update_flags(load_format, weight_version, flush_cache, abort_all_requests),
            # sglang: io_struct.py UpdateWeightsFromTensorReqInput.selector
            "selector": self._link.selector,
        }
        await self._send(op, body)

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
            **_update_flags(load_format, weight_version, flush_cache, abort_all_requests),
            # sglang: io_struct.py UpdateWeightsFromDistributedReqInput.selector
            "selector": self._link.selector,
        }
        await self._send(op, body)

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
        await self._send(op, body)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> None:
        """``POST /destroy_weights_update_group {"group_name"}``: leave the collective group."""
        # sglang: io_struct.py DestroyWeightsUpdateGroupReqInput (group_name);
        # http_server.py destroy_weights_update_group
        op = "destroy_weights_update_group"
        body = {"group_name": check_name("group_name", group_name)}
        await self._send(op, body)

    async def update_weight_version(self, version: str, *, abort_all_requests: bool) -> None:
        """``POST /update_weight_version``; ``abort_all_requests`` is always sent (server default
        is true, which would abort the requests a retract pause preserved)."""
        op = "update_weight_version"
        body = {
            "new_version": check_str("version", version, optional=False),
            "abort_all_requests": check_flag("abort_all_requests", abort_all_requests),
        }
        await self._send(op, body)

    # ----------------------------------------------------------------------------- probes

    async def model_info(self) -> dict[str, Any]:
        """``GET /model_info``: ``SGLangLink.model_info``."""
        return await self._link.model_info()

    async def weight_version(self) -> str | None:
        """The loaded weight version: ``SGLangLink.weight_version``."""
        return await self._link.weight_version()

    async def weight_fingerprint(self) -> dict[str, Any]:
        """``POST /weights_checker {"action": "checksum", "selector": "target"}``: a digest per
        tensor of the weights the engine holds, as ``Fingerprint.to_wire`` gives it (with
        tensor parallelism each name is prefixed with its rank, ``tp1:...``; data-parallel
        replicas that hold the same weights are one: ``_rank_checksums``)."""
        # sglang: http_server.py check_weights; tokenizer_control_mixin.py check_weights
        # (ranks: one ChecksumInfo per rank); utils/weight_checker.py _compute_checksum
        op = "weight_fingerprint"
        await self._link.attach(op)
        body = {"action": "checksum", "selector": "target"}
        answer = await self._link.call("weights_checker", body, op=op)
        tensors = _rank_checksums(answer)
        if tensors is None:
            self._link.garbage(op, "/weights_checker", f"no checksums in {answer!r:.200}")
        return Fingerprint(self.capabilities.fingerprint_scheme, tensors).to_wire()

    async def server_info(self) -> dict[str, Any]:
        """``GET /server_info``, the liveness probe, secrets masked: ``SGLangLink.server_info``."""
        return await self._link.server_info()

    async def observe(self, *, paused: bool = True, identify: bool = True) -> dict[str, Any]:
        """What the server says of itself (``EngineHost.observe``): ``SGLangLink.observe``."""
        return await self._link.observe(paused=paused, identify=identify)

    async def ready(self, timeout: float | None = None) -> bool:
        """One ``GET /ready`` (up and not paused): ``SGLangLink.ready``."""
        return await self._link.ready(timeout)

    async def ping(self, timeout: float | None = None) -> bool:
        """One ``GET /ping`` (up, paused or not): ``SGLangLink.ping``."""
        return await self._link.ping(timeout)

    async def check_version(self, op: str = "check_version") -> str:
        """The attach check on demand: ``SGLangLink.check_version``."""
        return await self._link.check_version(op)

    async def close(self) -> None:
        """Close the HTTP client; later calls raise ``EngineDead``. Idempotent, never raises."""
        await self._link.close()


def _update_flags(
    load_format: str | None, weight_version: str | None, flush_cache: bool, abort_all: bool
) -> dict[str, Any]:
    """The fields every weight update sends, checked, each stated explicitly."""
    return {
        "load_format": check_str("load_format", load_format, optional=True),
        "weight_version": check_str("weight_version", weight_version, optional=True),
        "flush_cache": check_flag("flush_cache", flush_cache),
        "abort_all_requests": check_flag("abort_all_requests", abort_all),
    }


def _rank_checksums(answer: dict[str, Any]) -> dict[str, str] | None:
    """Every rank's ``checksums`` of a ``/weights_checker`` answer in one mapping; None for an
    answer without them.

    A rank's ``parallelism_info`` places it. Tensor- and pipeline-parallel ranks hold different
    shards, so with more than one shard each name is prefixed with its shard (``tp1:w``, or
    ``pp1:tp0:w`` with pipeline stages). Data-parallel ranks (``dp_rank``) each hold the whole
    model: replicas that agree are one mapping, and replicas that differ are each prefixed with
    their rank (``dp1:w``), which no trainer's fingerprint matches, since the engine then does
    not serve one set of weights. A rank without ``parallelism_info`` is the tensor-parallel
    rank of its place in the list.
    """
    # sglang: tokenizer_control_mixin.py check_weights (one ChecksumInfo per scheduler: with
    # --dp-size 2 two entries, dp_rank 0 and 1, tp_rank 0 each; seen on a real 0.5.23 server)
    ranks = answer.get("ranks")
    if answer.get("success") is not True or not isinstance(ranks, list) or not ranks:
        return None
    shards: dict[tuple[int, int], dict[int, dict[str, str]]] = {}  # (pp, tp) -> dp -> sums
    for i, rank in enumerate(ranks):
        sums = rank.get("checksums") if isinstance(rank, dict) else None
        if not isinstance(sums, dict):
            return None
        pp, tp, dp = _placement(rank, i)
        shards.setdefault((pp, tp), {})[dp] = {str(k): str(v) for k, v in sums.items()}
    staged = any(pp for pp, _ in shards)
    tensors: dict[str, str] = {}
    for (pp, tp), replicas in shards.items():
        shard = "" if len(shards) == 1 else f"pp{pp}:tp{tp}:" if staged else f"tp{tp}:"
        first = next(iter(replicas.values()))
        if all(sums == first for sums in replicas.values()):
            tensors.update({shard + k: v for k, v in first.items()})
        else:
            for dp, sums in replicas.items():
                tensors.update({f"dp{dp}:{shard}{k}": v for k, v in sums.items()})
    return tensors


def _placement(rank: dict[str, Any], index: int) -> tuple[int, int, int]:
    """A ``/weights_checker`` rank's pipeline, tensor and data-parallel ranks, from its
    ``parallelism_info``; (0, ``index``, 0) when it names none."""
    info = rank.get("parallelism_info")
    first = info[0] if isinstance(info, list) and info and isinstance(info[0], dict) else None
    if first is None:
        return 0, index, 0
    found = (first.get("pp_rank", 0), first.get("tp_rank", index), first.get("dp_rank", 0))
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in found):
        return 0, index, 0
    return found


def sglang_http_factory(url: str, **kwargs: Any) -> Callable[[], SGLangHTTPEngine]:
    """A picklable zero-argument factory of ``SGLangHTTPEngine(url, **kwargs)``, for Ray actors.

    The arguments are checked now (constructing an engine opens nothing), so a mistake surfaces
    in the driver, not in an actor.
    """
    kwargs = secret_kwargs(kwargs, ("admin_key", "api_key"))
    SGLangHTTPEngine(url, **kwargs)
    return functools.partial(SGLangHTTPEngine, url, **kwargs)
